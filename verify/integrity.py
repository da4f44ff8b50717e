"""Integrity: patched files are what ddtree-patch wrote, added modules exist, no stale
bytecode for touched files, and the rest of vLLM matches its RECORD with no file
RECORD does not list.

Stdlib only: it runs inside the target env, and the patcher imports the same RECORD
check (``record_problems``) for ``revert``.
"""

import base64
import csv
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
    """RECORD rows as importlib.metadata makes them (PackagePath with .hash, .size),
    read tolerantly: blank lines, any line ending, extra columns (pip's installer warns
    about those and goes on).  A row without a path, with an unknown hash or a size
    that is not a number is an error."""
    record = os.path.join(str(dist_info), "RECORD")
    try:
        with open(record, "rb") as f:
            text = f.read().decode("utf-8")
        rows = [r for r in csv.reader(text.splitlines()) if any(c.strip() for c in r)]
        dist = metadata.PathDistribution(pathlib.Path(str(dist_info)))
        return [_row(dist, *r[:3]) for r in rows]
    except FileNotFoundError:
        raise RecordError(f"{record} is missing")
    except (UnicodeDecodeError, ValueError, OSError, csv.Error) as exc:
        raise RecordError(f"{record} cannot be read ({type(exc).__name__}: {exc})")


def _row(dist, path, hash_="", size=""):
    if not path.strip() or "\x00" in path:
        raise ValueError(f"a row without a usable path: {path!r}")
    f = metadata.PackagePath(path)
    f.hash = metadata.FileHash(hash_) if hash_ else None
    if f.hash is not None and (f.hash.mode not in hashlib.algorithms_available
                               or not f.hash.value):
        raise ValueError(f"{path}: unknown hash {hash_!r}")
    f.size = int(size) if size else None
    f.dist = dist
    return f


def _rows(site, dist_info):
    """(path relative to site, real path, RECORD hash) of each row inside ``site``
    (console scripts and the like outside it are left out)."""
    site = os.path.realpath(str(site))
    for f in record_files(dist_info):
        p = os.path.realpath(str(f.locate()))
        if p.startswith(site + os.sep):
            yield os.path.relpath(p, site).replace(os.sep, "/"), p, f.hash


def record_missing(site, dist_info):
    """RECORD's hashed files that are not there (a slim image deletes the kernels it
    does not use; bytecode, listed without a hash, may come and go)."""
    return sorted(rel for rel, p, digest in _rows(site, dist_info)
                  if digest is not None and not os.path.exists(p))


def _digest(path, algo):
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def record_problems(site, dist_info, skip=(), missing_ok=()):
    """Every RECORD row inside ``site`` whose file is missing or differs, every file
    under the package folders that RECORD does not list (stale bytecode of a module
    that exists is fine), and every folder there that holds nothing of RECORD's.
    ``skip``: paths (relative to site) to leave out, e.g. files ddtree-patch added;
    ``missing_ok``: files that may be missing (they were before ddtree-patch wrote)."""
    site = os.path.realpath(str(site))
    skip, missing_ok = set(skip), set(missing_ok)
    listed, parents, bad = set(), set(), []
    for rel, p, digest in _rows(site, dist_info):
        listed.add(rel)
        parent = os.path.dirname(rel)
        while parent and parent not in parents:
            parents.add(parent)
            parent = os.path.dirname(parent)
        if rel in skip or digest is None:
            continue
        if not os.path.exists(p):
            if rel not in missing_ok:
                bad.append({"path": rel, "problem": "missing"})
        elif _digest(p, digest.mode) != digest.value:
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
    missing = spec.get("missing", [])
    try:
        rows = record_problems(site, spec["dist_info"], skip=spec["files"],
                               missing_ok=missing)
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
    lacked = (f"; {len(missing)} files RECORD lists were missing before ddtree-patch "
              "applied (the install is incomplete, not checked)") if missing else ""
    return True, (f"{len(spec['files'])} patched/added files match, the rest of RECORD "
                  "matches, no unlisted files" + lacked)
