"""Integrity: patched files are what ddtree-patch wrote, added modules exist, no stale
bytecode for touched files, and the rest of vLLM matches its RECORD with no file
RECORD does not list.

Stdlib only: it runs inside the target env, and the patcher imports the same RECORD
check (``record_problems``) for ``revert``.
"""

import base64
import hashlib
import importlib.util
import os
import pathlib
from importlib import metadata


class RecordError(Exception):
    """vLLM's RECORD is missing or cannot be read."""


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def record_files(dist_info):
    """RECORD rows as importlib.metadata reads them: PackagePath with .hash, .size."""
    record = os.path.join(str(dist_info), "RECORD")
    if not os.path.isfile(record):
        raise RecordError(f"{record} is missing")
    try:
        files = metadata.PathDistribution(pathlib.Path(str(dist_info))).files
    except (UnicodeDecodeError, ValueError, OSError) as exc:
        raise RecordError(f"{record} cannot be read ({type(exc).__name__}: {exc})")
    if files is None:
        raise RecordError(f"{record} cannot be read")
    return files


def _digest(path, algo):
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def record_problems(site, dist_info, skip=()):
    """Every RECORD row inside ``site`` whose file is missing or differs, every file
    under the package folders that RECORD does not list (stale bytecode of a module
    that exists is fine), and every folder there that holds nothing of RECORD's.
    ``skip``: paths (relative to site) to leave out, e.g. files ddtree-patch added."""
    site = os.path.realpath(str(site))
    skip = set(skip)
    listed, parents, bad = set(), set(), []
    for f in record_files(dist_info):
        p = os.path.realpath(str(f.locate()))
        if not p.startswith(site + os.sep):
            continue  # console scripts etc. outside the tree
        rel = os.path.relpath(p, site).replace(os.sep, "/")
        listed.add(rel)
        parent = os.path.dirname(rel)
        while parent and parent not in parents:
            parents.add(parent)
            parent = os.path.dirname(parent)
        if rel in skip or f.hash is None:
            continue
        if not os.path.exists(p):
            bad.append({"path": rel, "problem": "missing"})
        elif _digest(p, f.hash.mode) != f.hash.value:
            bad.append({"path": rel, "problem": "hash differs from RECORD"})
    tops = {rel.split("/", 1)[0] for rel in listed if "/" in rel}
    for top in sorted(t for t in tops if not t.endswith(".dist-info")):
        for root, dirs, files in os.walk(os.path.join(site, top)):
            rel_root = os.path.relpath(root, site).replace(os.sep, "/")
            if rel_root not in parents and not files and not dirs:
                bad.append({"path": rel_root + "/", "problem": "empty folder RECORD does "
                            "not know"})
            for name in files:
                rel = f"{rel_root}/{name}"
                if rel in listed or rel in skip or _bytecode_with_source(root, name):
                    continue
                bad.append({"path": rel, "problem": "not listed in RECORD"})
    return bad


def _bytecode_with_source(folder, name):
    if not (name.endswith(".pyc") and os.path.basename(folder) == "__pycache__"):
        return False
    return os.path.exists(os.path.join(os.path.dirname(folder), name.split(".")[0] + ".py"))


def stale_pycs(py_path):
    """Cached bytecode of py_path that no longer matches the source."""
    cache = os.path.join(os.path.dirname(py_path), "__pycache__")
    stem = os.path.basename(py_path)[:-3]
    if not os.path.isdir(cache):
        return []
    st = os.stat(py_path)
    with open(py_path, "rb") as f:
        source = f.read()
    bad = []
    for name in os.listdir(cache):
        if not (name.endswith(".pyc") and name.split(".")[0] == stem):
            continue
        with open(os.path.join(cache, name), "rb") as f:
            head = f.read(16)
        flags = int.from_bytes(head[4:8], "little")
        if flags & 1:  # hash-based pyc
            ok = head[8:16] == importlib.util.source_hash(source)
        else:
            ok = (int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                  and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)
        if not ok:
            bad.append(os.path.join(cache, name))
    return bad


def check(spec):
    site = spec["site"]
    problems = []
    for rel, want in sorted(spec["files"].items()):
        p = os.path.join(site, rel)
        if not os.path.exists(p):
            problems.append(f"{rel}: missing (an added module was deleted?)")
        elif _sha(p) != want:
            problems.append(f"{rel}: differs from the patched content ddtree-patch wrote")
    for rel in sorted(spec["files"]):
        p = os.path.join(site, rel)
        if rel.endswith(".py") and os.path.exists(p):
            for pyc in stale_pycs(p):
                problems.append(f"stale bytecode {os.path.relpath(pyc, site)} (would run the "
                                "old code)")
    try:
        rows = record_problems(site, spec["dist_info"], skip=spec["files"])
    except RecordError as exc:
        rows = [{"path": "RECORD", "problem": str(exc)}]
    for row in rows:
        what = {"hash differs from RECORD": "differs from vLLM's RECORD (not a ddtree-patch "
                "file)", "missing": "listed in RECORD but missing"}.get(row["problem"],
                                                                        row["problem"])
        problems.append(f"{row['path']}: {what}")
    if problems:
        return False, "; ".join(problems[:10]) + (f" (+{len(problems) - 10} more)"
                                                 if len(problems) > 10 else "")
    return True, (f"{len(spec['files'])} patched/added files match, the rest of RECORD "
                  "matches, no unlisted files")
