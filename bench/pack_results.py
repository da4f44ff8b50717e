"""Raw benchmark results as one deterministic archive per run (bench/results/*.tar.xz).

    python bench/pack_results.py FOLDER [FILE ...] --name RUN [--out bench/results]
        packs FOLDER's files (or only the FILEs named, relative to FOLDER) as RUN/<path>
        into OUT/RUN.tar.xz: names sorted, mtime 0, owner 0:0 without names, mode 0644,
        xz preset 9e, so the same files always give the same bytes.
    python bench/pack_results.py --list ARCHIVE
        prints the members.

Read one back with ``tar xf bench/results/RUN.tar.xz -C DEST`` (DEST/RUN/...), or from
Python with ``read_member`` / ``extract`` below (stdlib only; ``bench/gpu/report.py``
takes an archive in place of a results folder).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile

MTIME = 0
PRESET = 9 | __import__("lzma").PRESET_EXTREME


def pack(folder: str, name: str, out_dir: str, files: list[str] | None = None) -> str:
    """OUT_DIR/NAME.tar.xz from FOLDER's files (all, or ``files``), members NAME/<path>."""
    if files is None:
        files = [os.path.relpath(os.path.join(d, f), folder)
                 for d, _, fs in os.walk(folder) for f in fs]
    files = sorted(f.replace(os.sep, "/") for f in files)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.tar.xz")
    with tarfile.open(path, "w:xz", preset=PRESET, format=tarfile.PAX_FORMAT) as tf:
        for rel in files:
            data = open(os.path.join(folder, rel), "rb").read()
            info = tarfile.TarInfo(f"{name}/{rel}")
            info.size, info.mtime, info.mode = len(data), MTIME, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tf.addfile(info, io.BytesIO(data))
    return path


def read_member(archive: str, member: str) -> bytes:
    """One member's bytes, e.g. read_member('bench/results/run3.tar.xz',
    'run3/step_bench.json')."""
    with tarfile.open(archive, "r:xz") as tf:
        f = tf.extractfile(member)
        if f is None:
            raise KeyError(f"{member} is not a file in {archive}")
        return f.read()


def extract(archive: str, dest: str) -> str:
    """Unpack into DEST; returns DEST/<the archive's one top folder>."""
    with tarfile.open(archive, "r:xz") as tf:
        tops = {m.name.split("/")[0] for m in tf.getmembers()}
        if len(tops) != 1:
            raise ValueError(f"{archive}: expected one top folder, got {sorted(tops)}")
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(dest, **kw)
    return os.path.join(dest, tops.pop())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?")
    ap.add_argument("files", nargs="*")
    ap.add_argument("--name")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--list", metavar="ARCHIVE")
    a = ap.parse_args(argv)
    if a.list:
        with tarfile.open(a.list, "r:xz") as tf:
            for m in tf.getmembers():
                print(f"{m.size:>9}  {m.name}")
        return 0
    if not a.folder or not a.name:
        ap.error("FOLDER and --name are needed to pack")
    print(pack(a.folder, a.name, a.out, a.files or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
