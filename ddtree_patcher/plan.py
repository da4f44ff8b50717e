"""What the files must become so that exactly a wanted set of transforms is applied.

``plan()`` runs four steps, all in memory, nothing written:
  check    read every file the transforms touch; each must be its pristine release
           bytes (pre-image) or what ddtree-patch last wrote (manifest): drift is
           reported per file before any codemod runs
  compose  run the wanted transforms in registry order over the pristine texts
  ops      per file: the bytes it must hold (or removal), only where that differs
  manifest what will be applied afterwards, with pre/post hashes per file
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import click

from . import __version__
from .errors import DRIFT, TARGET, TRANSFORM, PatchError
from .fsops import read_or_none, sha256_bytes, sha256_file
from .manifest import Action, FileRecord, Manifest, Status
from .state import State
from .target import Target


def registry():
    from .patches import BY_NAME, TRANSFORMS
    return TRANSFORMS, BY_NAME


def preimages(version: str) -> dict:
    from .patches.preimages import PREIMAGES
    return PREIMAGES.get(version, {})


@dataclass
class Op:
    path: str
    after: bytes | None  # None: remove the file
    before: bytes | None  # what is there now (None: absent)


@dataclass
class Plan:
    target: Target
    wanted: list[str]  # transforms applied afterwards
    ops: list[Op]
    manifest: Manifest | None  # manifest after the run (None: no patch left)
    backups: dict[str, bytes]  # pristine copies the new manifest needs
    transforms: dict[str, dict] = field(default_factory=dict)  # name -> {"status", ...}

    @property
    def changes(self) -> bool:
        return bool(self.ops)

    def diff(self, color: bool = False) -> str:
        styles = (("+++", dict(bold=True)), ("---", dict(bold=True)), ("+", dict(fg="green")),
                  ("-", dict(fg="red")), ("@@", dict(fg="cyan")))
        out = []
        for op in self.ops:
            a = (op.before or b"").decode("utf-8", "replace").splitlines(True)
            b = (op.after or b"").decode("utf-8", "replace").splitlines(True)
            src = f"a/{op.path}" if op.before is not None else "/dev/null"
            dst = f"b/{op.path}" if op.after is not None else "/dev/null"
            for line in difflib.unified_diff(a, b, src, dst):
                if not line.endswith("\n"):
                    line += "\n\\ No newline at end of file\n"
                if color:
                    style = next((s for p, s in styles if line.startswith(p)), None)
                    if style:
                        line = click.style(line.rstrip("\n"), **style) + "\n"
                out.append(line)
        return "".join(out)


# ------------------------------------------------------------------ file states


def file_state(t: Target, rel: str, rec: FileRecord | None) -> Status:
    """clean / patched / drifted / missing / reinstalled-since-patch for one file."""
    cur = sha256_file(t.path(rel))
    if rec is None:
        if cur is None:
            return Status.MISSING
        return Status.CLEAN if cur in preimages(t.base_version).get(rel, ()) else Status.DRIFTED
    if cur == rec.post_sha:
        return Status.PATCHED
    if rec.kind == "modify" and cur == rec.pre_sha:
        return Status.REINSTALLED
    if rec.kind == "add" and cur is None:
        return Status.MISSING
    return Status.DRIFTED


def live_records(t: Target, manifest: Manifest | None) -> dict[str, FileRecord]:
    """Manifest rows that still describe the files (a reinstall makes rows stale)."""
    if not manifest:
        return {}
    return {rel: rec for rel, rec in manifest.files.items()
            if file_state(t, rel, rec) not in (Status.REINSTALLED, Status.MISSING)}


# ------------------------------------------------------------------ 1. check


class Sources:
    """Pristine content of each file, read once: from the backup where ddtree-patch
    wrote the file, else from the tree (checked against the release's pre-image)."""

    def __init__(self, t: Target, state: State, live: dict[str, FileRecord], force: bool):
        self.t, self.state, self.live, self.force = t, state, live, force
        self.pristine: dict[str, bytes] = {}
        self.from_tree: dict[str, bytes] = {}  # read from the tree: backups to save
        self.drift: list[dict] = []

    def get(self, rel: str) -> bytes:
        if rel in self.pristine:
            return self.pristine[rel]
        p = self.t.path(rel)
        if rel in self.live:
            rec = self.live[rel]
            data = self.state.read_backup(rel, rec.pre_sha)
            cur = sha256_file(p)
            if cur != rec.post_sha and not self.force:
                self.drift.append({"path": rel, "problem": "edited since ddtree-patch wrote it",
                                   "sha256": cur})
        else:
            data = read_or_none(p)
            if data is None:
                raise PatchError(f"{rel} is missing from {self.t.site}", DRIFT,
                                 self.t.reinstall_hint())
            if sha256_bytes(data) not in preimages(self.t.base_version).get(rel, ()):
                self.drift.append({"path": rel, "problem": f"does not match any known "
                                   f"{self.t.dist} {self.t.base_version} file",
                                   "sha256": sha256_bytes(data)})
            self.from_tree[rel] = data
        self.pristine[rel] = data
        return data

    def raise_drift(self) -> None:
        if not self.drift:
            return
        ours = any(d["path"] in self.live for d in self.drift)
        hint = ("`ddtree-patch revert --force` puts the pristine files back, or "
                if ours else "") + self.t.reinstall_hint()
        raise PatchError("files differ from what ddtree-patch expects; nothing was written",
                         DRIFT, hint, details=self.drift)


def _families(wanted: list[str], version: str):
    transforms, _ = registry()
    return [(tr, tr.family(version)) for tr in transforms if tr.name in wanted]


def check(src: Sources, families) -> None:
    for _, fam in families:
        for e in (fam.edits if fam else ()):
            src.get(e.path)
    src.raise_drift()


# ------------------------------------------------------------------ 2. compose


@dataclass
class Composed:
    texts: dict[str, str] = field(default_factory=dict)  # rel -> patched text
    added: dict[str, bytes] = field(default_factory=dict)
    owners: dict[str, list[str]] = field(default_factory=dict)
    info: dict[str, dict] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)


def compose(t: Target, src: Sources, families) -> Composed:
    c = Composed()
    for tr, fam in families:
        if fam is None:
            c.info[tr.name] = {"status": Action.NA}
            continue
        if fam.upstream:
            missing = [e.path for e in fam.edits
                       if not e.is_applied(src.get(e.path).decode("utf-8"))]
            if missing:
                raise PatchError(f"{tr.name}: {t.dist} {t.version} should already contain "
                                 f"this change ({fam.note}) but it was not found in "
                                 + ", ".join(missing), DRIFT, t.reinstall_hint())
            c.info[tr.name] = {"status": Action.UPSTREAM, "note": fam.note}
            continue
        for e in fam.edits:
            text = c.texts.get(e.path)
            if text is None:
                text = src.get(e.path).decode("utf-8")
            try:
                new = e.apply(text)
            except Exception as exc:  # AnchorError, libcst parse errors: fail closed
                raise PatchError(f"{tr.name}: cannot edit {e.path}: {exc}", TRANSFORM,
                                 "nothing was written; this vLLM file is not the one the "
                                 "transform was written for: report it with `ddtree-patch "
                                 "status --json`")
            if not e.is_applied(new):
                raise PatchError(f"{tr.name}: the edit of {e.path} did not take effect",
                                 TRANSFORM, "nothing was written; report this as a bug")
            c.texts[e.path] = new
            c.owners.setdefault(e.path, []).append(tr.name)
        for a in fam.added:
            c.added[a.path] = a.content()
            c.owners.setdefault(a.path, []).append(tr.name)
        c.applied.append(tr.name)
        c.info[tr.name] = {"status": Action.APPLY}
    return c


# ------------------------------------------------------------------ 3. ops


def _symlink_problem(t: Target, rel: str) -> str | None:
    p = t.path(rel)
    while p != t.site and t.site in p.parents:
        if p.is_symlink():
            return f"{p} is a symbolic link"
        p = p.parent
    return None


def make_ops(t: Target, src: Sources, c: Composed, manifest: Manifest | None) -> list[Op]:
    live = src.live
    for rel, rec in live.items():  # no longer wanted: back to pristine / away
        if rec.kind == "modify" and rel not in c.texts:
            c.texts[rel] = src.get(rel).decode("utf-8")
        elif rec.kind == "add" and sha256_file(t.path(rel)) != rec.post_sha and not src.force:
            src.drift.append({"path": rel, "problem": "added file edited since",
                              "sha256": sha256_file(t.path(rel))})
    for rel in c.added:
        if rel not in live and t.path(rel).exists():
            src.drift.append({"path": rel, "problem": "a file ddtree-patch would add "
                              "already exists"})
    src.raise_drift()

    ops: list[Op] = []
    for rel, text in sorted(c.texts.items()):
        before, after = read_or_none(t.path(rel)), text.encode("utf-8")
        if before != after:
            ops.append(Op(rel, after, before))
    for rel, data in sorted(c.added.items()):
        before = read_or_none(t.path(rel))
        if before != data:
            ops.append(Op(rel, data, before))
    gone = [rel for rel, rec in live.items() if rec.kind == "add" and rel not in c.added]
    # added files of a stale manifest row (vLLM reinstalled since) go on revert too
    gone += [rel for rel, rec in (manifest.files.items() if manifest else ())
             if rec.kind == "add" and rel not in live and rel not in c.added]
    for rel in sorted(gone):
        before = read_or_none(t.path(rel))
        if before is not None:
            ops.append(Op(rel, None, before))
    links = [why for why in (_symlink_problem(t, op.path) for op in ops) if why]
    if links:
        raise PatchError("ddtree-patch does not write through symbolic links (that would "
                         "change the linked file for everything sharing it) nor replace "
                         "them; nothing was written", TARGET,
                         "reinstall vLLM with real files (uv: --link-mode=copy), or patch "
                         "a copy of the environment", details=links)
    return ops


# ------------------------------------------------------------------ 4. manifest


def make_manifest(t: Target, src: Sources, c: Composed,
                  missing: list[str]) -> Manifest | None:
    files: dict[str, FileRecord] = {}
    for rel, text in c.texts.items():
        if rel in c.owners:
            files[rel] = FileRecord("modify", sha256_bytes(src.pristine[rel]),
                                    sha256_bytes(text.encode("utf-8")), c.owners[rel])
    for rel, data in c.added.items():
        files[rel] = FileRecord("add", None, sha256_bytes(data), c.owners[rel])
    if not files:
        return None
    return Manifest(t.install(), c.applied, dict(sorted(files.items())), __version__,
                    missing=list(missing))


def plan(t: Target, state: State, manifest: Manifest | None, wanted: list[str],
         force: bool = False, missing: list[str] | None = None) -> Plan:
    """``missing``: RECORD's files the install lacked at apply time (default: what the
    manifest says)."""
    src = Sources(t, state, live_records(t, manifest), force)
    families = _families(wanted, t.base_version)
    check(src, families)
    c = compose(t, src, families)
    ops = make_ops(t, src, c, manifest)
    if missing is None:
        missing = manifest.missing if manifest else []
    new = make_manifest(t, src, c, missing)
    backups = {rel: data for rel, data in src.from_tree.items()
               if new and rel in new.files and new.files[rel].kind == "modify"}
    return Plan(t, c.applied, ops, new, backups, c.info)
