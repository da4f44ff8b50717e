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


def copy_tree(dist: str, version: str, dest: Path) -> Path:
    """A private copy of the installed tree: sources and metadata are real copies, the
    large binaries are hard links (ddtree-patch never writes them, and it never writes
    in place, so the template stays intact; the tests check that too)."""
    src = installed_tree(dist, version)

    def copy(s, d):
        if s.endswith((".py", ".pyc")) or ".dist-info" in s:
            return shutil.copy2(s, d)
        os.link(s, d)
        return d

    shutil.copytree(src, dest, copy_function=copy, ignore=shutil.ignore_patterns(".complete"),
                    symlinks=True)
    return dest
