"""Real vLLM wheels for the tests: downloaded once with pip, cached outside the repo.

Cache: $DDTREE_PATCH_WHEEL_CACHE or ~/.cache/ddtree-patch/wheels.  Installed trees
(``pip install --no-deps --target``) are cached next to it as templates that the tests
copy before touching.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("DDTREE_PATCH_WHEEL_CACHE",
                            Path.home() / ".cache" / "ddtree-patch" / "wheels"))


def wheel_path(dist: str, version: str) -> Path:
    stem = dist.replace("-", "_")
    CACHE.mkdir(parents=True, exist_ok=True)
    hits = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    if not hits:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12",
                        "--platform", "manylinux_2_35_x86_64", "--platform",
                        "manylinux_2_28_x86_64", "-d", str(CACHE), f"{dist}=={version}"],
                       check=True)
        hits = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    return hits[0]


def installed_tree(dist: str, version: str) -> Path:
    """A cached ``pip install --no-deps --target`` of the real wheel (a read-only
    template: use ``copy_tree`` before changing anything)."""
    root = CACHE.parent / "trees" / f"{dist}-{version}"
    if (root / ".complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test runs build it once
        if not (root / ".complete").exists():
            _install(dist, version, root)
    return root


def _install(dist: str, version: str, root: Path) -> None:
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", str(tmp),
                    str(wheel_path(dist, version))], check=True)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    (root / ".complete").touch()


def copy_tree(dist: str, version: str, dest: Path, slim: bool = False) -> Path:
    """A private copy of the installed tree: sources and metadata are real copies, the
    large binaries are hard links (ddtree-patch never writes them, and it never writes
    in place, so the template stays intact; the tests check that too).

    ``slim``: only the Python files (and their bytecode) and the dist-info, RECORD
    without the rows of what was left out (compiled extensions, headers, data): every
    module of the real release, cheap to check against RECORD many times."""
    src = installed_tree(dist, version)

    def copy(s, d):
        if s.endswith((".py", ".pyc")) or ".dist-info" in s:
            return shutil.copy2(s, d)
        os.link(s, d)
        return d

    left_out = set()

    def ignore(folder, names):
        out = {".complete"} & set(names)
        if slim and ".dist-info" not in folder:
            other = {n for n in names if not n.endswith((".py", ".pyc"))
                     and os.path.isfile(os.path.join(folder, n))}
            left_out.update(Path(folder, n).relative_to(src).as_posix() for n in other)
            out |= other
        return out

    shutil.copytree(src, dest, copy_function=copy, ignore=ignore, symlinks=True)
    if slim:
        import csv
        import io

        record = next(dest.glob("*.dist-info")) / "RECORD"
        with open(record, newline="") as f:
            rows = [r for r in csv.reader(f) if r and r[0] not in left_out]
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows)
        record.write_text(out.getvalue())  # a real copy (copy2), not the template's
        _prune_empty(dest / "vllm")
    return dest


def _prune_empty(top: Path) -> None:
    for root, _dirs, _files in os.walk(top, topdown=False):
        if not os.listdir(root):
            os.rmdir(root)


def upgrade_in_place(site: Path, dist: str, version: str, slim: bool = False) -> None:
    """What ``pip install --upgrade --target`` does to a tree: every file the old RECORD
    lists goes (files it does not list, e.g. ones ddtree-patch added, stay; folders
    left empty go), then the new release's files land."""
    import csv

    old = next(site.glob(f"{dist.replace('-', '_')}-*.dist-info"))
    with open(old / "RECORD", newline="") as f:
        for row in csv.reader(f):
            p = (site / row[0]).resolve() if row else None
            if p is not None and site.resolve() in p.parents and p.is_file():
                p.unlink()
    shutil.rmtree(old, ignore_errors=True)
    _prune_empty(site / "vllm")
    new = copy_tree(dist, version, site.with_name(site.name + ".new"), slim=slim)
    for root, dirs, files in os.walk(new):
        rel = Path(root).relative_to(new)
        (site / rel).mkdir(exist_ok=True)
        for name in files:
            os.replace(Path(root) / name, site / rel / name)
    shutil.rmtree(new)
