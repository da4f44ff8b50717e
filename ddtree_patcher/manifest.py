"""What ddtree-patch saves and reads back, checked field by field: the install it belongs
to, the manifest (what is applied, per file hashes) and the journal of a run.  Plus the
typed statuses the commands report."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from enum import Enum

from .fsops import temp_name

MANIFEST_SCHEMA = 2  # 1: no install binding (read as such)
JOURNAL_SCHEMA = 2


class Status(str, Enum):
    """Status of a file, a transform, or the whole install."""

    CLEAN = "clean"
    PATCHED = "patched"
    UPSTREAM = "upstream"  # the release ships the change
    PARTIAL = "partial"
    DRIFTED = "drifted"
    MISSING = "missing"
    REINSTALLED = "reinstalled-since-patch"
    NA = "n/a"  # no family for this version
    INTERRUPTED = "interrupted"  # a journal is left: run `recover`
    STALE = "stale-state"  # the saved state belongs to another install

    def __str__(self) -> str:
        return self.value


class Action(str, Enum):
    """What a plan does with a transform."""

    APPLY = "apply"
    UPSTREAM = "upstream"
    NA = "n/a"

    def __str__(self) -> str:
        return self.value


class StateError(ValueError):
    """A saved file does not have the shape ddtree-patch writes."""


def _get(d, key: str, types, where: str):
    if not isinstance(d, dict):
        raise StateError(f"{where}: expected an object, found {type(d).__name__}")
    if key not in d:
        raise StateError(f"{where}: field {key!r} is missing")
    v = d[key]
    if not isinstance(v, types):
        raise StateError(f"{where}: field {key!r} has type {type(v).__name__}")
    return v


def _rel(v, where: str, package: bool = True) -> str:
    """A path relative to site-packages that stays inside it (``package``: inside
    vllm/, where everything ddtree-patch writes lives).  Checked before any use."""
    parts = v.split("/") if isinstance(v, str) else [""]
    if any(p in ("", ".", "..") or "\x00" in p or "\\" in p for p in parts) or (
            package and (parts[0] != "vllm" or len(parts) < 2)):
        raise StateError(f"{where}: {v!r} is not a path inside vLLM's "
                         + ("package folder" if package else "site-packages"))
    return v


def _number(d, key: str, types, where: str):
    v = d.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, types):
        raise StateError(f"{where}: field {key!r} is not a number")
    return v


def _sha(v, where: str, none_ok: bool = False):
    if v is None and none_ok:
        return None
    if not (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)):
        raise StateError(f"{where}: not a sha256: {v!r}")
    return v


@dataclass(frozen=True)
class Install:
    """The exact install saved state belongs to.  Its place is the real path of its
    site-packages (links resolved), or the same folder by device and inode (a bind
    mount), so every name of one tree is the same install."""

    dist: str
    version: str
    site_packages: str  # real path (older manifests: the absolute path used then)
    dist_info: str
    record_sha256: str | None  # None: a schema-1 manifest (not recorded)

    def same_place(self, site: str) -> bool:
        """Is ``site`` (a real path) this install's folder?"""
        if os.path.realpath(self.site_packages) == site:
            return True
        try:
            return os.path.samefile(self.site_packages, site)
        except OSError:
            return False

    def differences(self, now: "Install") -> list[str]:
        out = []
        for key in ("dist", "version", "record_sha256"):
            a, b = getattr(self, key), getattr(now, key)
            if a is not None and a != b:
                out.append(f"{key}: saved {a}, now {b}")
        if not self.same_place(now.site_packages):
            out.append(f"site_packages: saved {self.site_packages}, now {now.site_packages}")
        elif os.path.basename(self.dist_info) != os.path.basename(now.dist_info):
            out.append(f"dist_info: saved {self.dist_info}, now {now.dist_info}")
        return out

    @classmethod
    def from_json(cls, d, where: str) -> "Install":
        vals = {k: _get(d, k, str, where) for k in ("dist", "version", "site_packages",
                                                    "dist_info")}
        return cls(**vals, record_sha256=_sha(d.get("record_sha256"), where, none_ok=True))


@dataclass
class FileRecord:
    kind: str  # "modify" | "add"
    pre_sha: str | None  # pristine content (modify only)
    post_sha: str
    transforms: list[str]


@dataclass
class Manifest:
    install: Install
    applied: list[str]
    files: dict[str, FileRecord]
    tool_version: str = ""
    updated: str = ""
    run: str = ""  # id of the run that wrote it
    missing: list[str] = field(default_factory=list)  # RECORD's files absent at apply

    def to_json(self) -> dict:
        return {"schema": MANIFEST_SCHEMA, "tool_version": self.tool_version,
                "install": asdict(self.install), "applied": list(self.applied),
                "files": {k: asdict(v) for k, v in sorted(self.files.items())},
                "missing": list(self.missing), "updated": self.updated, "run": self.run}

    def same_content(self, other: "Manifest | None") -> bool:
        """Equal apart from when and by which run it was written."""
        return other is not None and (self.install, self.applied, self.files) == (
            other.install, other.applied, other.files)

    @classmethod
    def from_json(cls, d) -> "Manifest":
        w = "manifest.json"
        schema = _get(d, "schema", int, w)
        if schema == 1:
            install = Install(_get(d, "dist", str, w), _get(d, "version", str, w),
                              _get(d, "site_packages", str, w), _get(d, "dist_info", str, w),
                              None)
        elif schema == MANIFEST_SCHEMA:
            install = Install.from_json(_get(d, "install", dict, w), w + " install")
        else:
            raise StateError(f"{w}: schema {schema} is not one this ddtree-patch reads")
        applied = _get(d, "applied", list, w)
        if not all(isinstance(a, str) for a in applied):
            raise StateError(f"{w}: 'applied' must list transform names")
        files = {}
        for rel, rec in _get(d, "files", dict, w).items():
            where = f"{w} files[{rel!r}]"
            _rel(rel, where)
            kind = _get(rec, "kind", str, where)
            if kind not in ("modify", "add"):
                raise StateError(f"{where}: kind {kind!r}")
            names = _get(rec, "transforms", list, where)
            files[rel] = FileRecord(kind, _sha(rec.get("pre_sha"), where, kind == "add"),
                                    _sha(rec.get("post_sha"), where), [str(n) for n in names])
        missing = d.get("missing", [])
        if not isinstance(missing, list):
            raise StateError(f"{w}: 'missing' must list paths")
        missing = [_rel(m, f"{w} missing", package=False) for m in missing]
        return cls(install, list(applied), files, str(d.get("tool_version", "")),
                   str(d.get("updated", "")), str(d.get("run", "")), missing)


@dataclass
class JournalEntry:
    path: str
    before: str | None  # name of the saved copy in the journal folder (None: absent)
    before_sha: str | None
    after_sha: str | None  # None: the run removes the file
    tmp: str  # name of the temp file the write goes through (same folder)


@dataclass
class Journal:
    op: str
    token: str  # run id: temp names and the manifest's "run"
    install: Install
    entries: list[JournalEntry]
    new_dirs: list[str]  # folders the run creates, deepest first
    manifest_before_sha: str | None
    manifest_after_sha: str | None
    pid: int = 0
    started: float = 0.0
    backups: list[str] = field(default_factory=list)  # backups this run saved

    def to_json(self) -> dict:
        d = asdict(self)
        d["schema"] = JOURNAL_SCHEMA
        return d

    @classmethod
    def from_json(cls, d) -> "Journal":
        """Every name in it checked: paths inside vllm/, saved copies and temp files
        named as ddtree-patch names them (a journal is never followed elsewhere)."""
        w = "journal.json"
        if _get(d, "schema", int, w) != JOURNAL_SCHEMA:
            raise StateError(f"{w}: schema {d['schema']} is not one this ddtree-patch reads")
        token = _get(d, "token", str, w)
        if not re.fullmatch(r"[0-9a-f]{8,64}", token):
            raise StateError(f"{w}: token {token!r} is not a run id")
        entries = []
        for i, e in enumerate(_get(d, "entries", list, w)):
            where = f"{w} entries[{i}]"
            path = _rel(_get(e, "path", str, where), where)
            before = e.get("before")
            if before is not None and not (isinstance(before, str)
                                           and re.fullmatch(r"before-[0-9]+", before)):
                raise StateError(f"{where}: saved copy {before!r} is not one ddtree-patch "
                                 "names")
            tmp = _get(e, "tmp", str, where)
            if tmp != temp_name(path, token):
                raise StateError(f"{where}: temp file {tmp!r} is not the one ddtree-patch "
                                 f"names for {path}")
            entries.append(JournalEntry(
                path, before, _sha(e.get("before_sha"), where, none_ok=before is None),
                _sha(e.get("after_sha"), where, none_ok=True), tmp))
        backups = _get(d, "backups", list, w) if "backups" in d else []
        return cls(_get(d, "op", str, w), token,
                   Install.from_json(_get(d, "install", dict, w), w + " install"), entries,
                   [_rel(x, f"{w} new_dirs") for x in _get(d, "new_dirs", list, w)],
                   _sha(d.get("manifest_before_sha"), w, none_ok=True),
                   _sha(d.get("manifest_after_sha"), w, none_ok=True),
                   _number(d, "pid", int, w), _number(d, "started", (int, float), w),
                   [_rel(x, f"{w} backups") for x in backups])
