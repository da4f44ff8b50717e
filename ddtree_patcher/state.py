"""Per-install state kept outside site-packages: manifest, pristine backups, journal.

Folder: ``$DDTREE_PATCH_STATE_DIR`` or ``$XDG_STATE_HOME/ddtree-patch`` or
``~/.local/state/ddtree-patch``, then one sub-folder per install (hash of its
site-packages' real path).  pip never sees it, so a reinstall cannot leave a marker that
lies; what is in it is bound to the exact install (``manifest.Install``).  Its files
are input like any other: nothing is read or written through a link leading out of it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .errors import DRIFT, TARGET, PatchError
from .fsops import (TMP_SUFFIX, atomic_write, inside, make_dirs, point, prune_dirs,
                    remove_file, sha256_bytes, writable_problem)
from .manifest import Journal, Manifest, StateError

STATE_HINT = "set DDTREE_PATCH_STATE_DIR to a writable folder (or fix HOME)"


def state_root() -> Path:
    env = os.environ.get("DDTREE_PATCH_STATE_DIR")
    if env:
        return Path(env).absolute()
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "ddtree-patch"
    home = os.path.expanduser("~")
    if not os.path.isabs(home) or not os.path.isdir(home):
        raise PatchError(f"no state folder: the home folder {home!r} does not exist "
                         "(HOME is not set or wrong)", TARGET, STATE_HINT)
    return Path(home) / ".local" / "state" / "ddtree-patch"


def _state_error(path: Path, exc: OSError) -> PatchError:
    return PatchError(f"the state folder cannot be used: {path}: {exc.strerror or exc}",
                      TARGET, STATE_HINT + "; nothing was written to vLLM")


def state_for(key: str, site: str, reinstall_hint: str = "") -> "State":
    """The install's state folder, named by its real path ``site``; for another name of
    the same folder with another real path (a bind mount), the one saved for it."""
    own = State(key, reinstall_hint)
    root = own.dir.parent
    if own.dir.exists() or not root.is_dir():
        return own
    for d in sorted(root.iterdir()):
        other = State(d.name, reinstall_hint)
        try:
            saved = other.load_journal() or other.load_manifest()
        except PatchError:
            continue
        if saved is not None and saved.install.same_place(site):
            return other
    return own


class State:
    def __init__(self, key: str, reinstall_hint: str = ""):
        self.dir = state_root() / key
        self.backups = self.dir / "backups"
        self.journal_dir = self.dir / "journal"
        self.manifest_path = self.dir / "manifest.json"
        self.journal_path = self.journal_dir / "journal.json"
        self.reinstall_hint = reinstall_hint or "reinstall vLLM"

    # -------------------------------------------------------------- the folder
    def ensure_writable(self) -> None:
        """Create the folder, or say why it cannot be used (before anything is written)."""
        d = self.dir
        while not d.exists() and d.parent != d:
            d = d.parent  # the deepest folder that exists must be a writable folder
        why = (f"{d} is not a folder" if not d.is_dir() else writable_problem(d))
        if why is None:
            try:
                make_dirs(self.dir)
            except OSError as exc:
                why = f"{self.dir}: {exc.strerror or exc}"
        if why:
            raise PatchError(f"the state folder cannot be used: {why}", TARGET,
                             STATE_HINT + "; nothing was written to vLLM")

    def _read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:  # the folder is a file, no permission, ...
            raise _state_error(path, exc)

    def _inside(self, path: Path) -> Path:
        if not inside(path, self.dir):
            raise PatchError(f"{path} leads outside the state folder {self.dir} (a link?): "
                             "ddtree-patch does not follow it; nothing was written", DRIFT,
                             "put the real folder in place of the link, or set "
                             "DDTREE_PATCH_STATE_DIR to a folder only you can write; then "
                             "run the command again")
        return path

    def check_inside(self, backups) -> None:
        """Before a run writes: its journal and backups stay in the state folder."""
        for p in [self.journal_path] + [self.backups / rel for rel in backups]:
            self._inside(p)

    def _unreadable(self, path: Path, why) -> PatchError:
        return PatchError(
            f"the saved state {path} is unreadable ({why}): ddtree-patch cannot tell what "
            "it changed", DRIFT,
            f"{self.reinstall_hint}, then `ddtree-patch forget` (drops the unreadable state "
            "and removes only files that hold ddtree-patch's own bytes)")

    def leftovers(self, manifest: Manifest | None) -> list[str]:
        """What a run killed before its journal was complete left here: temp files,
        journal copies, backups the manifest does not need."""
        if not self.dir.is_dir():
            return []
        keep = {rel for rel, rec in (manifest.files.items() if manifest else ())
                if rec.kind == "modify"}
        out = [p for p in self.dir.rglob("*") if p.is_file() and (
            p.name.endswith(TMP_SUFFIX) or self.journal_dir in p.parents
            or (self.backups in p.parents and p.relative_to(self.backups).as_posix()
                not in keep))]
        return sorted(str(p.relative_to(self.dir)) for p in out)

    def clean_temp(self) -> None:
        """Temp files a killed write left in the state folder."""
        if self.dir.is_dir():
            for p in self.dir.rglob("*" + TMP_SUFFIX):
                remove_file(p)

    def tidy(self) -> None:
        """Remove the folder once it holds no file (nothing applied, no journal)."""
        if self.dir.is_dir() and not any(p.is_file() for p in self.dir.rglob("*")):
            shutil.rmtree(self.dir, ignore_errors=True)
            point(f"state folder removed {self.dir}")

    def forget(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        point(f"forgot {self.dir}")

    # -------------------------------------------------------------- manifest
    def manifest_sha(self) -> str | None:
        data = self._read(self.manifest_path)
        return sha256_bytes(data) if data is not None else None

    def load_manifest(self) -> Manifest | None:
        data = self._read(self.manifest_path)
        if data is None:
            return None
        try:
            return Manifest.from_json(json.loads(data))
        except (ValueError, StateError) as exc:  # JSON errors are ValueErrors
            raise self._unreadable(self.manifest_path, exc)

    def save_manifest(self, manifest: Manifest | None) -> None:
        if manifest is None:
            remove_file(self.manifest_path)
            return
        atomic_write(self.manifest_path, manifest_bytes(manifest))

    # -------------------------------------------------------------- backups
    def backup_path(self, rel: str) -> Path:
        return self._inside(self.backups / rel)

    def save_backup(self, rel: str, data: bytes) -> None:
        p = self.backup_path(rel)
        if self._read(p) == data:
            return
        make_dirs(p.parent)
        atomic_write(p, data, mode=0o644)

    def read_backup(self, rel: str, expect_sha: str) -> bytes:
        data = self._read(self.backup_path(rel))
        if data is None or sha256_bytes(data) != expect_sha:
            raise PatchError(f"the backup of {rel} in {self.backups} is "
                             + ("missing" if data is None else "corrupt"), DRIFT,
                             f"{self.reinstall_hint}, then run `ddtree-patch status`")
        return data

    def prune_backups(self, keep: set[str]) -> None:
        """Remove every backup but those of ``keep`` (what the manifest still needs)."""
        if not self.backups.is_dir():
            return
        for p in sorted(self.backups.rglob("*")):
            if p.is_file() and p.relative_to(self.backups).as_posix() not in keep:
                remove_file(p)
                prune_dirs(p.parent, self.backups)
        if not keep:
            shutil.rmtree(self.backups, ignore_errors=True)

    # -------------------------------------------------------------- journal
    def load_journal(self) -> Journal | None:
        data = self._read(self.journal_path)
        if data is None:
            return None
        try:
            return Journal.from_json(json.loads(data))
        except (ValueError, StateError) as exc:
            raise self._unreadable(self.journal_path, exc)

    def has_journal(self) -> bool:
        return self.journal_path.exists()

    def save_journal(self, j: Journal, befores: dict[str, bytes]) -> None:
        make_dirs(self.journal_dir)
        for name, data in befores.items():
            atomic_write(self._inside(self.journal_dir / name), data, mode=0o644)
        atomic_write(self.journal_path, json.dumps(j.to_json()).encode(), mode=0o644)

    def read_before(self, name: str, expect_sha: str) -> bytes:
        data = self._read(self._inside(self.journal_dir / name))
        if data is None or sha256_bytes(data) != expect_sha:
            raise self._unreadable(self.journal_dir / name, "a saved copy is missing or "
                                   "corrupt")
        return data

    def clear_journal(self) -> None:
        """journal.json goes first: a kill half-way leaves no journal to act on."""
        remove_file(self.journal_path)
        if self.journal_dir.exists():
            shutil.rmtree(self.journal_dir, ignore_errors=True)
            point(f"journal cleared {self.journal_dir}")


def manifest_bytes(manifest: Manifest | None) -> bytes | None:
    if manifest is None:
        return None
    return json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode()
