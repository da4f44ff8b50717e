"""Plan, apply and revert transforms as one transaction.

Every command computes, in memory, the full content each touched file should have
(pristine backup -> the wanted transforms, composed in registry order), checks every
pre-image hash, and only then writes: backups first, then a journal, then atomic
replaces, then the manifest.  A run that dies half-way is rolled back by the next
invocation (``recover``), using the journal's copies of what each file was before.
"""

from __future__ import annotations

import difflib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .errors import DRIFT, IO, TARGET, TRANSFORM, USAGE, PatchError
from .fsops import (atomic_write, remove_bytecode, remove_file, sha256_bytes, sha256_file,
                    writable_problem)
from .state import MANIFEST_SCHEMA, State
from .target import Target


def _registry():
    from .patches import BY_NAME, TRANSFORMS
    return TRANSFORMS, BY_NAME


def _preimages() -> dict:
    from .patches.preimages import PREIMAGES
    return PREIMAGES


@dataclass
class Op:
    path: str
    after: bytes | None  # None: remove the file
    before: bytes | None  # what is there now (None: absent)


@dataclass
class Plan:
    target: Target
    wanted: list[str]  # transforms that will be applied afterwards
    ops: list[Op]
    manifest: dict | None  # manifest after the run (None: no patch left)
    backups: dict[str, bytes]  # pristine copies still to save
    transforms: dict[str, dict] = field(default_factory=dict)  # name -> status info
    notes: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return bool(self.ops)

    def diff(self, color: bool = False) -> str:
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
                    if line.startswith(("+++", "---")):
                        line = f"\x1b[1m{line.rstrip(chr(10))}\x1b[0m\n"
                    elif line.startswith("+"):
                        line = f"\x1b[32m{line.rstrip(chr(10))}\x1b[0m\n"
                    elif line.startswith("-"):
                        line = f"\x1b[31m{line.rstrip(chr(10))}\x1b[0m\n"
                    elif line.startswith("@@"):
                        line = f"\x1b[36m{line.rstrip(chr(10))}\x1b[0m\n"
                out.append(line)
        return "".join(out)


# ------------------------------------------------------------------ file states


def file_state(t: Target, rel: str, rec: dict | None) -> str:
    """clean / patched / drifted / missing / reinstalled-since-patch for one file."""
    cur = sha256_file(t.path(rel))
    if rec is None:
        if cur is None:
            return "missing"
        return "clean" if cur in _preimages().get(t.base_version, {}).get(rel, ()) else "drifted"
    if cur == rec["post_sha"]:
        return "patched"
    if rec["kind"] == "modify" and cur == rec["pre_sha"]:
        return "reinstalled-since-patch"
    if rec["kind"] == "add" and cur is None:
        return "missing"
    return "drifted"


def _live_records(t: Target, manifest: dict | None) -> dict[str, dict]:
    """Manifest rows that still describe the files (a reinstall makes rows stale)."""
    if not manifest:
        return {}
    live = {}
    for rel, rec in manifest["files"].items():
        st = file_state(t, rel, rec)
        if st in ("reinstalled-since-patch", "missing"):
            continue
        live[rel] = rec
    return live


# ------------------------------------------------------------------ planning


def plan(t: Target, state: State, wanted: list[str], force: bool = False) -> Plan:
    """What the files must become so that exactly ``wanted`` is applied."""
    transforms, _ = _registry()
    version = t.base_version
    manifest = state.load_manifest()
    live = _live_records(t, manifest)
    pre = _preimages().get(version, {})
    drift = []
    pristine: dict[str, bytes] = {}
    backups: dict[str, bytes] = {}

    def source(rel: str) -> bytes:
        if rel in pristine:
            return pristine[rel]
        p = t.path(rel)
        if rel in live:
            rec = live[rel]
            data = state.read_backup(rel, rec["pre_sha"])
            cur = sha256_file(p)
            if cur != rec["post_sha"] and not force:
                drift.append({"path": rel, "problem": "edited since ddtree-patch wrote it",
                              "sha256": cur})
        else:
            try:
                data = p.read_bytes()
            except FileNotFoundError:
                raise PatchError(f"{rel} is missing from {t.site}", DRIFT,
                                 _reinstall_hint(t))
            if sha256_bytes(data) not in pre.get(rel, ()):
                drift.append({"path": rel, "problem": f"does not match any known {t.dist} "
                              f"{version} file", "sha256": sha256_bytes(data)})
            backups[rel] = data
        pristine[rel] = data
        return data

    def drift_error() -> PatchError:
        return PatchError("files differ from what ddtree-patch expects; nothing was written",
                          DRIFT, "restore them with `ddtree-patch revert --force` (puts the "
                          "pristine files back) or " + _reinstall_hint(t), details=drift)

    # Read and check every file first: drift is reported per file, before any codemod.
    for tr in transforms:
        fam = tr.family(version)
        if tr.name in wanted and fam is not None:
            for e in fam.edits:
                source(e.path)
    if drift:
        raise drift_error()

    texts: dict[str, str] = {}
    owners: dict[str, list[str]] = {}
    added: dict[str, bytes] = {}
    info: dict[str, dict] = {}
    applied: list[str] = []
    for tr in transforms:
        fam = tr.family(version)
        if tr.name not in wanted:
            continue
        if fam is None:
            info[tr.name] = {"status": "n/a"}
            continue
        if fam.upstream:
            missing = [e.path for e in fam.edits
                       if not e.is_applied(source(e.path).decode("utf-8"))]
            if missing:
                raise PatchError(f"{tr.name}: {t.dist} {version} should already contain this "
                                 f"change ({fam.note}) but it was not found in "
                                 + ", ".join(missing), DRIFT, _reinstall_hint(t))
            info[tr.name] = {"status": "upstream", "note": fam.note}
            continue
        for e in fam.edits:
            text = texts.get(e.path)
            if text is None:
                text = source(e.path).decode("utf-8")
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
            texts[e.path] = new
            owners.setdefault(e.path, []).append(tr.name)
        for a in fam.added:
            added[a.path] = a.content()
            owners.setdefault(a.path, []).append(tr.name)
        applied.append(tr.name)
        info[tr.name] = {"status": "apply"}

    # Files touched before but no longer wanted go back to pristine / away.
    for rel, rec in live.items():
        if rec["kind"] == "modify" and rel not in texts:
            texts[rel] = source(rel).decode("utf-8")
        elif rec["kind"] == "add":
            cur = sha256_file(t.path(rel))
            if cur != rec["post_sha"] and not force:
                drift.append({"path": rel, "problem": "added file edited since", "sha256": cur})
    for rel in added:
        if rel not in live and t.path(rel).exists():
            drift.append({"path": rel, "problem": "a file ddtree-patch would add already exists"})

    if drift:
        raise drift_error()

    ops: list[Op] = []
    files: dict[str, dict] = {}
    for rel, text in sorted(texts.items()):
        after = text.encode("utf-8")
        before = _read(t.path(rel))
        if before != after:
            ops.append(Op(rel, after, before))
        if rel in owners:
            files[rel] = {"kind": "modify", "pre_sha": sha256_bytes(pristine[rel]),
                          "post_sha": sha256_bytes(after), "transforms": owners[rel]}
    for rel, data in sorted(added.items()):
        before = _read(t.path(rel))
        if before != data:
            ops.append(Op(rel, data, before))
        files[rel] = {"kind": "add", "pre_sha": None, "post_sha": sha256_bytes(data),
                      "transforms": owners[rel]}
    for rel, rec in sorted(live.items()):
        if rec["kind"] == "add" and rel not in added:
            ops.append(Op(rel, None, _read(t.path(rel))))
    # Stray added files of a stale manifest (vLLM reinstalled since): remove on revert.
    if manifest:
        for rel, rec in manifest["files"].items():
            if rec["kind"] == "add" and rel not in live and rel not in added \
                    and t.path(rel).exists():
                ops.append(Op(rel, None, _read(t.path(rel))))

    new_manifest = None
    if files:
        new_manifest = {
            "schema": MANIFEST_SCHEMA, "tool_version": __version__, "dist": t.dist,
            "version": t.version, "site_packages": str(t.site), "dist_info": str(t.dist_info),
            "applied": applied, "files": files,
        }
    keep_backups = {rel: data for rel, data in backups.items()
                    if rel in files and files[rel]["kind"] == "modify"}
    return Plan(t, applied, ops, new_manifest, keep_backups, info)


def _read(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except FileNotFoundError:
        return None


def _reinstall_hint(t: Target) -> str:
    return (f"reinstall vLLM: {t.python or 'python'} -m pip install --force-reinstall --no-deps "
            f"{t.dist}=={t.version}")


# ------------------------------------------------------------------ execution


def _fault(when: str, step: int) -> None:
    """Test hook: DDTREE_PATCH_FAULT=crash-after:N kills the process (no cleanup) once N
    files are written; fail-at:N raises an OSError before write N (0-based)."""
    kind, _, n = os.environ.get("DDTREE_PATCH_FAULT", "").partition(":")
    if kind == "crash-after" and when == "after" and step == int(n):
        os._exit(70)
    if kind == "fail-at" and when == "before" and step == int(n):
        raise OSError(f"injected write failure at step {step}")


def check_writable(t: Target, paths: list[str]) -> None:
    problems = []
    for rel in paths:
        p = t.path(rel)
        d = p.parent
        while not d.exists():
            d = d.parent
        for q in ([p] if p.exists() else []) + [d]:
            why = writable_problem(q)
            if why:
                problems.append(why)
    if problems:
        raise PatchError("the vLLM install is read-only here; nothing was written",
                         TARGET, "run as the user that owns the environment, or "
                         "make a writable copy (a virtualenv) and patch that",
                         details=sorted(set(problems)))


def _manifest_bytes(manifest: dict | None) -> bytes | None:
    if manifest is None:
        return None
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def execute(p: Plan, state: State, op_name: str) -> None:
    """Write a plan: backups, journal, atomic replaces, manifest; roll back on error."""
    if not p.ops and p.manifest == state.load_manifest():
        return
    check_writable(p.target, [op.path for op in p.ops])
    for rel, data in p.backups.items():
        state.save_backup(rel, data)
    if p.manifest is not None:
        p.manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    after = _manifest_bytes(p.manifest)
    jdir = state.journal_dir
    jdir.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, op in enumerate(p.ops):
        if op.before is not None:
            atomic_write(jdir / f"before-{i}", op.before, mode=0o644)
        entries.append({"path": op.path, "before": f"before-{i}" if op.before is not None
                        else None, "before_sha": sha256_bytes(op.before) if op.before is not
                        None else None, "after_sha": sha256_bytes(op.after) if op.after
                        is not None else None})
    atomic_write(state.journal_path, json.dumps({
        "op": op_name, "pid": os.getpid(), "started": time.time(), "entries": entries,
        "manifest_after_sha": sha256_bytes(after) if after is not None else None,
    }).encode(), mode=0o644)
    try:
        for i, op in enumerate(p.ops):
            _fault("before", i)
            path = p.target.path(op.path)
            if op.after is None:
                remove_file(path)
                _prune_dirs(path.parent, p.target.site / "vllm")
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, op.after)
            if path.suffix == ".py":
                remove_bytecode(path)
            _fault("after", i + 1)
        if p.manifest is None:
            state.save_manifest(None)
            state.drop_backups()
        else:
            state.save_manifest(p.manifest)
    except Exception as exc:
        rolled = recover(p.target, state)
        raise PatchError(f"{op_name} failed while writing ({exc}); rolled back "
                         f"({len(rolled['restored']) if rolled else 0} files restored)",
                         IO, "fix the cause (disk full? permissions?) and run the command "
                         "again")
    state.clear_journal()


def _prune_dirs(d: Path, stop: Path) -> None:
    """Remove folders emptied by a revert (bytecode caches included), up to ``stop``."""
    d, stop = d.resolve(), stop.resolve()
    while d != stop and stop in d.parents:
        cache = d / "__pycache__"
        if cache.is_dir() and not any(x for x in cache.iterdir()):
            cache.rmdir()
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


def recover(t: Target, state: State) -> dict | None:
    """Finish or undo a run that was interrupted. Returns what was done, or None."""
    j = state.load_journal()
    if j is None:
        state.clear_journal()
        return None
    cur = _manifest_bytes(state.load_manifest())
    cur_sha = sha256_bytes(cur) if cur is not None else None
    if cur_sha == j["manifest_after_sha"] and all(
            sha256_file(t.path(e["path"])) == e["after_sha"] for e in j["entries"]):
        state.clear_journal()
        return {"op": j["op"], "action": "completed", "restored": []}
    restored = []
    for e in j["entries"]:
        path = t.path(e["path"])
        if sha256_file(path) == e["before_sha"]:
            continue
        if e["before"] is None:
            remove_file(path)
            _prune_dirs(path.parent, t.site / "vllm")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, (state.journal_dir / e["before"]).read_bytes())
        if path.suffix == ".py":
            remove_bytecode(path)
        restored.append(e["path"])
    state.clear_journal()
    return {"op": j["op"], "action": "rolled back", "restored": restored}


# ------------------------------------------------------------------ status


def status(t: Target, state: State) -> dict:
    """Per transform and file: clean / patched / upstream / partial / drifted /
    reinstalled-since-patch (and n/a for transforms without a family for the version)."""
    transforms, _ = _registry()
    manifest = state.load_manifest()
    recs = manifest["files"] if manifest else {}
    applied = manifest["applied"] if manifest else []
    rows = []
    for tr in transforms:
        fam = tr.family(t.base_version)
        if fam is None:
            rows.append({"transform": tr.name, "status": "n/a", "files": []})
            continue
        files = []
        added = {a.path for a in fam.added}
        for rel in [e.path for e in fam.edits] + sorted(added):
            rec = recs.get(rel)
            st = file_state(t, rel, rec)
            if rel in added and rec is None and st == "missing":
                st = "clean"  # not added yet: what a clean install looks like
            elif fam.upstream and st in ("clean", "patched"):
                st = "upstream"  # the change ships with vLLM (patched: by others)
            elif tr.name not in applied and st == "patched":
                st = "clean"  # written for another transform; this one is not in it
            files.append({"path": rel, "status": st})
        rows.append({"transform": tr.name, "files": files,
                     "status": _combine({f["status"] for f in files}, tr.name in applied)})
    seen = {r["status"] for r in rows}
    journal = state.load_journal()
    for overall in ("drifted", "reinstalled-since-patch", "partial", "patched"):
        if overall in seen:
            break
    else:
        overall = "clean"
    if journal is not None:
        overall = "interrupted"
    return {"target": t.describe(), "status": overall, "applied": applied,
            "transforms": rows, "interrupted": journal is not None,
            "state_dir": str(state.dir)}


def _combine(states: set[str], applied: bool) -> str:
    if "drifted" in states:
        return "drifted"
    if len(states) == 1:
        only = next(iter(states))
        if only == "missing":
            return "partial" if applied else "drifted"
        return only
    if applied and states <= {"reinstalled-since-patch", "missing"}:
        return "reinstalled-since-patch"
    return "partial"


def resolve_names(only: tuple[str, ...], skip: tuple[str, ...]) -> list[str]:
    transforms, by_name = _registry()
    for n in list(only) + list(skip):
        if n not in by_name:
            raise PatchError(f"unknown transform {n!r}", USAGE,
                             "known transforms: " + ", ".join(by_name) +
                             " (see `ddtree-patch list`)")
    names = list(only) if only else [tr.name for tr in transforms]
    names = [n for n in names if n not in skip]
    # pull in what the chosen transforms need
    out: list[str] = []

    def add(n):
        for r in by_name[n].requires:
            add(r)
        if n not in out:
            out.append(n)

    for n in names:
        add(n)
    return out


def with_dependents(names) -> set[str]:
    """``names`` plus every transform that requires one of them (reverting a transform
    takes out what is built on it)."""
    transforms, _ = _registry()
    out = set(names)
    changed = True
    while changed:
        changed = False
        for tr in transforms:
            if tr.name not in out and out & set(tr.requires):
                out.add(tr.name)
                changed = True
    return out
