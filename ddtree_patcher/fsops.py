"""File operations that never write in place: hashes, atomic replace, bytecode cleanup.

Every durable change goes through ``point()`` once it is made, so a test can kill the
process right after any of them (``DDTREE_PATCH_FAULT=kill-at:N``) and list them all
(``DDTREE_PATCH_FAULT_LOG=file``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import tempfile
from pathlib import Path

TMP_SUFFIX = ".ddtree-tmp"
_points = [0]


def point(label: str) -> None:
    """A write point: log it, and SIGKILL ourselves here when the test asks for it
    (``DDTREE_PATCH_FAULT=kill-at:N``), or send another signal (``signal-at:N:TERM``)."""
    _points[0] += 1
    n = _points[0]
    log = os.environ.get("DDTREE_PATCH_FAULT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{n} {label}\n")
    fault = os.environ.get("DDTREE_PATCH_FAULT", "")
    if fault == f"kill-at:{n}":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.startswith(f"signal-at:{n}:"):  # e.g. signal-at:12:INT (Ctrl-C), :TERM
        sig = getattr(signal, "SIG" + fault.rsplit(":", 1)[1])
        if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
            # started in the background of a non-interactive shell (SIGINT ignored):
            # a Ctrl-C reaches a foreground run, whose Python turns it into an exception
            signal.signal(sig, signal.default_int_handler)
        os.kill(os.getpid(), sig)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str | None:
    try:
        return sha256_bytes(Path(path).read_bytes())
    except FileNotFoundError:
        return None


def read_or_none(path: Path) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path, token: str) -> str:
    """The temp file a journaled write of ``path`` uses (recovery removes it)."""
    return f".{Path(path).name}.{token}{TMP_SUFFIX}"


def atomic_write(path: Path, data: bytes, like: Path | None = None, mode: int = 0o644,
                 tmp_name: str | None = None) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and os.replace.

    The new file takes mode and owner from ``like`` (default: the file it replaces).
    Never writes in place, so a hard-linked original (uv's cache) stays intact.
    ``tmp_name``: a fixed temp name (journaled by the caller); a stale one is replaced.
    """
    path = Path(path)
    ref = like if like is not None else path
    try:
        st = os.stat(ref)
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        owner = None
    if tmp_name is None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    else:
        tmp = str(path.parent / tmp_name)
        remove_file(Path(tmp), sync=False)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        point(f"temp written {tmp}")
        os.chmod(tmp, mode)
        if owner is not None and hasattr(os, "chown"):
            try:
                os.chown(tmp, *owner)
            except PermissionError:
                pass  # not root: the file keeps our uid, as pip would leave it
        os.replace(tmp, path)
    except BaseException:
        remove_file(Path(tmp), sync=False)
        raise
    fsync_dir(path.parent)
    point(f"replaced {path}")


def remove_file(path: Path, sync: bool = True) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    if sync:
        fsync_dir(Path(path).parent)
        point(f"removed {path}")
    return True


def make_dirs(path: Path, like_parent: bool = False) -> None:
    """mkdir -p, one write point per folder created.  ``like_parent`` (folders added
    to vLLM): each new folder gets its parent's permission bits (setgid included),
    whatever the umask, so a hardened umask does not hide new modules from the user
    that runs vLLM.  Otherwise (the state folder) the umask applies."""
    path = Path(path)
    if path.is_dir():
        return
    make_dirs(path.parent, like_parent)
    try:
        path.mkdir()
    except FileExistsError:
        return
    if like_parent:
        try:
            mode = stat.S_IMODE(os.stat(path.parent).st_mode) & 0o2777
        except OSError:
            mode = 0o755
        os.chmod(path, mode)
    point(f"mkdir {path}")


def prune_dirs(d: Path, stop: Path) -> None:
    """Remove folders left empty (an empty bytecode cache included), up to ``stop``."""
    d, stop = Path(d).absolute(), Path(stop).absolute()
    while d != stop and stop in d.parents:
        cache = d / "__pycache__"
        if cache.is_dir() and not any(cache.iterdir()):
            cache.rmdir()
            point(f"rmdir {cache}")
        try:
            d.rmdir()
        except OSError:
            return
        point(f"rmdir {d}")
        d = d.parent


def bytecode_of(py_path: Path) -> list[Path]:
    """Every cached .pyc of a module (all interpreters, all optimisation levels)."""
    py_path = Path(py_path)
    cache = py_path.parent / "__pycache__"
    out = []
    if cache.is_dir():
        out = [p for p in cache.glob(py_path.stem + ".*.pyc")
               if p.name.split(".")[0] == py_path.stem]
    legacy = py_path.with_suffix(".pyc")  # Python 2 style, still honoured when sourceless
    if legacy.exists():
        out.append(legacy)
    return out


def remove_bytecode(py_path: Path, emptied: bool = False) -> list[Path]:
    """Remove the module's bytecode, and its __pycache__ folder when that leaves it
    empty (``emptied``: the caller knows an empty one was emptied by this run)."""
    removed = bytecode_of(py_path)
    for pyc in removed:
        pyc.unlink()
    if removed:
        point(f"bytecode removed {py_path}")
    cache = Path(py_path).parent / "__pycache__"
    if (removed or emptied) and cache.is_dir() and not any(cache.iterdir()):
        cache.rmdir()
        point(f"rmdir {cache}")
    return removed


def inside(path: Path, folder: Path) -> bool:
    """Does ``path``, links resolved, stay inside ``folder`` (links resolved)?"""
    top = os.path.realpath(folder)
    return os.path.realpath(path).startswith(top.rstrip(os.sep) + os.sep)


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
