"""File operations that never write in place: hashes, atomic replace, bytecode cleanup."""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import tempfile
from pathlib import Path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str | None:
    try:
        return sha256_bytes(Path(path).read_bytes())
    except FileNotFoundError:
        return None


def record_hash(data: bytes) -> str:
    """The hash form of a wheel RECORD row (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, like: Path | None = None, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and os.replace.

    The new file takes mode and owner from ``like`` (default: the file it replaces).
    Never writes in place, so a hard-linked original (uv's cache) stays intact.
    """
    path = Path(path)
    ref = like if like is not None else path
    try:
        st = os.stat(ref)
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        owner = None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ddtree-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if owner is not None and hasattr(os, "chown"):
            try:
                os.chown(tmp, *owner)
            except PermissionError:
                pass  # not root: the file keeps our uid, as pip would leave it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def remove_file(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def remove_bytecode(py_path: Path) -> list[Path]:
    """Delete every cached .pyc of a module (all interpreters, all optimisation levels)."""
    py_path = Path(py_path)
    cache = py_path.parent / "__pycache__"
    removed = []
    if cache.is_dir():
        for pyc in cache.glob(py_path.stem + ".*.pyc"):
            if pyc.name.split(".")[0] == py_path.stem:
                pyc.unlink()
                removed.append(pyc)
    legacy = py_path.with_suffix(".pyc")  # Python 2 style, still honoured when sourceless
    if legacy.exists():
        legacy.unlink()
        removed.append(legacy)
    return removed


def stale_bytecode(py_path: Path) -> list[Path]:
    py_path = Path(py_path)
    cache = py_path.parent / "__pycache__"
    if not cache.is_dir():
        return []
    return [p for p in cache.glob(py_path.stem + ".*.pyc") if p.name.split(".")[0] == py_path.stem]


def writable_problem(path: Path) -> str | None:
    """Why ``path`` (a file or folder that exists) must not be written, or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{path} is on a read-only file system"
    except (AttributeError, OSError):
        pass
    if not os.access(path, os.W_OK):
        return f"{path} is not writable by this user"
    if not st.st_mode & 0o222:
        return f"{path} has no write permission bits (mode {oct(stat.S_IMODE(st.st_mode))})"
    return None
