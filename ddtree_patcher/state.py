"""Per-install state kept outside site-packages: manifest, pristine backups, journal, lock.

Folder: ``$DDTREE_PATCH_STATE_DIR`` or ``~/.local/state/ddtree-patch``, then one
sub-folder per install (hash of its site-packages path).  pip never sees it, so a
reinstall cannot leave a marker that lies.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from .errors import LOCKED, PatchError
from .fsops import atomic_write, sha256_bytes

MANIFEST_SCHEMA = 1


def state_root() -> Path:
    env = os.environ.get("DDTREE_PATCH_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                           "state")
    return Path(base) / "ddtree-patch"


class State:
    def __init__(self, key: str):
        self.dir = state_root() / key
        self.backups = self.dir / "backups"
        self.journal_dir = self.dir / "journal"

    # -------------------------------------------------------------- manifest
    @property
    def manifest_path(self) -> Path:
        return self.dir / "manifest.json"

    def load_manifest(self) -> dict | None:
        try:
            return json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return None

    def save_manifest(self, manifest: dict | None) -> None:
        if manifest is None:
            try:
                os.unlink(self.manifest_path)
            except FileNotFoundError:
                pass
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.manifest_path, json.dumps(manifest, indent=1, sort_keys=True).encode())

    # -------------------------------------------------------------- backups
    def backup_path(self, rel: str) -> Path:
        return self.backups / rel

    def save_backup(self, rel: str, data: bytes) -> None:
        p = self.backup_path(rel)
        if p.exists() and p.read_bytes() == data:
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, data, mode=0o644)

    def read_backup(self, rel: str, expect_sha: str) -> bytes:
        try:
            data = self.backup_path(rel).read_bytes()
        except FileNotFoundError:
            raise PatchError(f"the backup of {rel} is missing from {self.backups}", 4,
                             "reinstall vLLM: python -m pip install --force-reinstall --no-deps "
                             "<dist>==<version>, then run ddtree-patch status")
        if sha256_bytes(data) != expect_sha:
            raise PatchError(f"the backup of {rel} in {self.backups} is corrupt", 4,
                             "reinstall vLLM: python -m pip install --force-reinstall --no-deps "
                             "<dist>==<version>, then run ddtree-patch status")
        return data

    def drop_backups(self) -> None:
        shutil.rmtree(self.backups, ignore_errors=True)

    # -------------------------------------------------------------- journal
    @property
    def journal_path(self) -> Path:
        return self.journal_dir / "journal.json"

    def load_journal(self) -> dict | None:
        try:
            return json.loads(self.journal_path.read_text())
        except FileNotFoundError:
            return None

    def clear_journal(self) -> None:
        shutil.rmtree(self.journal_dir, ignore_errors=True)

    # -------------------------------------------------------------- lock
    @contextmanager
    def lock(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "lock"
        f = open(path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise PatchError(f"another ddtree-patch run holds the lock on this install "
                             f"(pid {holder}, lock {path})", LOCKED,
                             "wait for it to finish and run the command again")
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()
