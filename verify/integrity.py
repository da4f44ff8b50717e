"""Integrity: patched files are what ddtree-patch wrote, added modules exist, no stale
bytecode for touched files, and vLLM's own untouched files still match RECORD."""

import csv
import importlib.util
import os


def _sha(path):
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _record_hash(path):
    import base64
    import hashlib
    with open(path, "rb") as f:
        d = hashlib.sha256(f.read()).digest()
    return base64.urlsafe_b64encode(d).rstrip(b"=").decode()


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
    touched = set(spec["files"])
    with open(os.path.join(spec["dist_info"], "RECORD"), newline="") as f:
        for row in csv.reader(f):
            if len(row) < 2 or not row[1].startswith("sha256=") or row[0] in touched:
                continue
            p = os.path.normpath(os.path.join(site, row[0]))
            if not p.startswith(os.path.normpath(site) + os.sep):
                continue
            if not os.path.exists(p):
                problems.append(f"{row[0]}: listed in RECORD but missing")
            elif _record_hash(p) != row[1][7:]:
                problems.append(f"{row[0]}: differs from vLLM's RECORD (not a ddtree-patch "
                                "file)")
    if problems:
        return False, "; ".join(problems[:10]) + (f" (+{len(problems) - 10} more)"
                                                 if len(problems) > 10 else "")
    return True, f"{len(spec['files'])} patched/added files and the rest of RECORD match"
