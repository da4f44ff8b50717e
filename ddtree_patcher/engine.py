"""The operations: apply, revert, recover, forget, status.

Each owns what makes it safe: the lock on the target tree, the check that saved state
belongs to this exact install (dist, version, RECORD digest, path), the recovery of an
interrupted run, the wanted set of transforms, and (apply) verify with a revert of what
that apply wrote when verify fails.  The CLI only parses and prints.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import DRIFT, TARGET, USAGE, VERIFY, PatchError
from .fsops import (prune_dirs, read_or_none, remove_bytecode, remove_file, sha256_bytes,
                    sha256_file)
from .journal import execute, leftovers, rollback
from .manifest import Journal, Manifest, Status
from .plan import Plan, file_state, plan, preimages, registry
from .state import State, state_for
from .target import Target, check_version, missing_files, record_mismatches


# ------------------------------------------------------------------ names


def resolve_names(only=(), skip=()) -> tuple[list[str], dict[str, str]]:
    """The transforms asked for (registry order) and notes on what was pulled in."""
    transforms, by_name = registry()
    for n in list(only) + list(skip):
        if n not in by_name:
            raise PatchError(f"unknown transform {n!r}", USAGE,
                             "known transforms: " + ", ".join(by_name) +
                             " (see `ddtree-patch list`)")
    both = sorted(set(only) & set(skip))
    if both:
        raise PatchError(f"--only and --skip both name {', '.join(both)}", USAGE,
                         "name each transform in one of them")
    names = set(only) if only else {tr.name for tr in transforms} - set(skip)
    notes: dict[str, str] = {}

    def add(n: str, by: str | None) -> None:
        if by is not None and n in skip:
            raise PatchError(f"{by} needs {n}, which --skip leaves out", USAGE,
                             f"add --skip {by} as well, or drop --skip {n}")
        for r in by_name[n].requires:
            add(r, n)
        if n not in names:
            notes[n] = f"needed by {by}"
        names.add(n)

    for n in sorted(names):
        add(n, None)
    return [tr.name for tr in transforms if tr.name in names], notes


def with_dependents(names) -> set[str]:
    """``names`` plus every transform that requires one of them (reverting a transform
    takes out what is built on it)."""
    transforms, _ = registry()
    out = set(names)
    changed = True
    while changed:
        changed = False
        for tr in transforms:
            if tr.name not in out and out & set(tr.requires):
                out.add(tr.name)
                changed = True
    return out


def _ordered(names) -> list[str]:
    transforms, _ = registry()
    return [tr.name for tr in transforms if tr.name in set(names)]


# ------------------------------------------------------------------ binding


def _stale(t: Target, state: State, saved, now) -> PatchError:
    s = saved.install
    held = held_edits(t, saved)
    return PatchError(
        f"the saved state in {state.dir} belongs to {s.dist} {s.version}, not to "
        f"this install ({now.dist} {now.version}): vLLM was upgraded or reinstalled since "
        "ddtree-patch last wrote it; nothing was written (its backups would put "
        f"{s.version} files into this install)", DRIFT,
        _reinstall_first(t, held) if held else
        "`ddtree-patch forget` drops that state and removes only the files ddtree-patch "
        "added (they hold its own bytes and no RECORD lists them); if vLLM's RECORD was "
        "damaged instead, " + t.reinstall_hint(), details=s.differences(now))


def _reinstall_first(t: Target, held: list[str]) -> str:
    return (f"{t.reinstall_hint()} (puts vLLM's own files back in place of the {len(held)} "
            "that still hold ddtree-patch's edits), then `ddtree-patch forget`")


def held_edits(t: Target, *saved) -> list[str]:
    """vLLM files that still hold ddtree-patch's edits (they import what it added):
    what the saved state says it wrote, or, without it, any edit of this release's
    transforms found in a file that is not the release's own."""
    out = set()
    for s in saved:
        rows = ([(rel, r.post_sha) for rel, r in s.files.items() if r.kind == "modify"]
                if isinstance(s, Manifest) else [(e.path, e.after_sha) for e in s.entries
                                                 if e.before is not None and e.after_sha]
                if isinstance(s, Journal) else [])
        out.update(rel for rel, sha in rows
                   if t.contains(rel) and sha256_file(t.path(rel)) == sha)
    known = preimages(t.base_version)
    transforms, _ = registry()
    for fam in filter(None, (tr.family(t.base_version) for tr in transforms)):
        for e in () if fam.upstream else fam.edits:
            data = read_or_none(t.path(e.path))
            if data is not None and sha256_bytes(data) not in known.get(e.path, ()) \
                    and _applied(e, data):
                out.add(e.path)
    return sorted(out)


def _applied(edit, data: bytes) -> bool:
    try:
        return edit.is_applied(data.decode("utf-8", "replace"))
    except Exception:  # not Python any more: not an edit ddtree-patch can recognise
        return False


def _check_bound(t: Target, state: State, *saved) -> None:
    saved = [s for s in saved if s is not None]
    now = t.install() if saved else None
    for s in saved:
        if s.install.differences(now):
            raise _stale(t, state, s, now)


def _state(t: Target) -> State:
    return state_for(t.key, t.real, t.reinstall_hint())


@contextmanager
def _session(t: Target):
    """Lock the target, then finish or undo an interrupted run first."""
    state = _state(t)
    with t.lock():
        done = _recover(t, state)
        if done and done["drift"]:
            raise _recover_drift(done)
        yield state, done


def _recover_drift(done: dict) -> PatchError:
    return PatchError(f"an interrupted {done['op']} was rolled back "
                      f"({len(done['restored'])} files restored), but these files changed "
                      "after it and were left as they are", DRIFT,
                      "look at them (`ddtree-patch status`); `ddtree-patch revert --force` "
                      "puts pristine files back where ddtree-patch wrote them, or reinstall "
                      "vLLM", details=done["drift"])


def _recover(t: Target, state: State) -> dict | None:
    if state.has_journal():
        _check_bound(t, state, state.load_journal())
    elif not state.dir.is_dir():
        return None
    return rollback(t, state)


def _pristine_check(t: Target, p: Plan, missing_ok: list[str]) -> list[dict]:
    """vLLM's RECORD check after a full revert (files were written already)."""
    try:
        return record_mismatches(t, missing_ok)
    except PatchError as exc:
        raise PatchError(f"{len(p.ops)} files restored, but {exc.message}", exc.code,
                         exc.hint)


# ------------------------------------------------------------------ operations


@dataclass
class Outcome:
    plan: Plan
    recovered: dict | None = None
    wrote: bool = False
    notes: dict[str, str] = field(default_factory=dict)
    verify: dict | None = None
    record_mismatches: list[dict] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # RECORD's files the install lacks


def _incomplete(t: Target, wanted: list[str]) -> list[str]:
    """RECORD's files this install lacks (slim images delete kernels), found before
    anything is written: refused when a file the wanted transforms read is one."""
    missing = missing_files(t)
    transforms, _ = registry()
    fams = [tr.family(t.base_version) for tr in transforms if tr.name in wanted]
    hit = sorted({e.path for fam in fams if fam for e in fam.edits} & set(missing))
    if hit:
        raise PatchError(f"{lacks(missing)}, among them {len(hit)} that ddtree-patch must "
                         "edit: the install, not ddtree-patch, is incomplete; nothing was "
                         "written", TARGET, t.reinstall_hint() + " (puts the missing files "
                         "back), then run the command again", details=hit)
    return missing


def lacks(missing: list[str], first: int = 3) -> str:
    more = f", ... and {len(missing) - first} more" if len(missing) > first else ""
    return (f"this vLLM install lacks {len(missing)} files its RECORD lists ("
            + ", ".join(missing[:first]) + more + ")")


def dry_run(t: Target, names: list[str], vllm_version: str | None = None) -> Plan:
    """The plan apply would write (read-only: no lock, nothing written)."""
    check_version(t, vllm_version)
    state = _state(t)
    journal = state.load_journal()
    manifest = state.load_manifest()
    _check_bound(t, state, journal, manifest)
    if journal is not None:
        raise PatchError("an interrupted run is pending: the diff would not be what apply "
                         "writes", DRIFT, "`ddtree-patch recover` first")
    wanted = _ordered((manifest.applied if manifest else []) + names)
    return plan(t, state, manifest, wanted, missing=_incomplete(t, wanted))


def apply(t: Target, names: list[str], verify: str | None = "quick",
          keep_on_failure: bool = False, vllm_version: str | None = None) -> Outcome:
    """Apply ``names`` on top of what is applied; verify (``"quick"``/``"full"``/None);
    when verify fails, go back to what was applied before (or keep, for debugging)."""
    check_version(t, vllm_version)
    with _session(t) as (state, recovered):
        manifest = state.load_manifest()
        _check_bound(t, state, manifest)
        before = manifest.applied if manifest else []
        wanted = _ordered(before + names)
        missing = _incomplete(t, wanted)
        p = plan(t, state, manifest, wanted, missing=missing)
        out = Outcome(p, recovered, execute(p, state, manifest, "apply"), missing=missing)
        if not (out.wrote and p.ops and verify and p.manifest):
            return out
        from .verify_client import run_verify

        out.verify = run_verify(t, quick=verify == "quick")
        if out.verify["ok"]:
            return out
        if keep_on_failure:
            raise PatchError("verify failed after apply; patched files kept "
                             "(--keep-on-failure)", VERIFY, "inspect, then `ddtree-patch "
                             "revert`", details=out.verify["failed"])
        back = plan(t, state, p.manifest, before)
        execute(back, state, p.manifest, "revert")
        kept = f" (what was applied before stays: {', '.join(before)})" if before else ""
        raise PatchError("verify failed after apply; the patch was reverted" + kept, VERIFY,
                         "report `ddtree-patch apply --keep-on-failure --json` output as a "
                         "bug", details=out.verify["failed"])


def revert(t: Target, names=(), force: bool = False) -> Outcome:
    """Take ``names`` (and what depends on them) out, or everything; byte-exact, and a
    full revert ends with vLLM's RECORD check."""
    with _session(t) as (state, recovered):
        manifest = state.load_manifest()
        _check_bound(t, state, manifest)
        applied = manifest.applied if manifest else []
        drop = with_dependents(names) if names else set(applied)
        p = plan(t, state, manifest, [n for n in applied if n not in drop], force=force)
        out = Outcome(p, recovered, execute(p, state, manifest, "revert"),
                      missing=manifest.missing if manifest else [])
        if not p.wanted:
            out.record_mismatches = _pristine_check(t, p, out.missing)
        return out


def recover(t: Target) -> dict | None:
    """Finish or undo an interrupted run (None: there was none).  Files changed after
    the run are left alone and reported (exit 4)."""
    state = _state(t)
    with t.lock():
        done = _recover(t, state)
    if done and done["drift"]:
        raise _recover_drift(done)
    return done


def forget(t: Target) -> dict:
    """Drop saved state that no longer belongs to this install (or cannot be read) and
    remove what ddtree-patch added: only files holding its own bytes that the install's
    RECORD does not list, its temp files, and the folders it made.  Nothing else."""
    state = _state(t)
    with t.lock():
        saved, unreadable = [], []
        for load in (state.load_journal, state.load_manifest):
            try:
                saved.append(load())
            except PatchError as exc:
                unreadable.append(exc.message)
                saved.append(None)
        journal, manifest = saved
        now = t.install()
        stale = [s for s in (journal, manifest) if s and s.install.differences(now)]
        if not stale and not unreadable and journal is None and manifest is None:
            state.tidy()
            return {"removed": [], "state_dir": str(state.dir), "forgot": False}
        if not stale and not unreadable:
            raise PatchError("the saved state belongs to this install: forgetting it would "
                             "lose the backups revert needs", USAGE,
                             "`ddtree-patch revert` (or `ddtree-patch recover` for an "
                             "interrupted run)")
        held = held_edits(t, *[s for s in saved if s is not None])
        if held:
            raise PatchError(f"{len(held)} vLLM files still hold ddtree-patch's edits: they "
                             "import the files forget would remove, so forgetting now would "
                             "leave a vLLM that does not import; nothing was removed", DRIFT,
                             _reinstall_first(t, held), details=held)
        removed = _remove_leftovers(t, journal, manifest)
        state.forget()
        return {"removed": removed, "state_dir": str(state.dir), "forgot": True,
                "why": [d for s in stale for d in s.install.differences(now)] + unreadable}


def _remove_leftovers(t: Target, journal: Journal | None, manifest: Manifest | None) -> list:
    from .verify.integrity import RecordError, record_files

    try:
        listed = {str(f.locate()) for f in record_files(t.dist_info)}
    except RecordError as exc:
        raise PatchError(f"vLLM's RECORD cannot be read ({exc}): cannot tell its files "
                         "from ddtree-patch's", TARGET, t.reinstall_hint())
    ours = set(leftovers(t, journal, manifest))
    transforms, _ = registry()
    for tr in transforms:  # added files as this ddtree-patch ships them (any version)
        for fam in tr.families:
            for a in fam.added:
                p = t.path(a.path)
                if p.is_file() and sha256_bytes(p.read_bytes()) == sha256_bytes(a.content()):
                    ours.add(p)
    removed = []
    for p in sorted(ours):
        if str(p) in listed:
            continue
        remove_file(p)
        if p.suffix == ".py":
            remove_bytecode(p)
        prune_dirs(p.parent, t.package)
        removed.append(str(p.relative_to(t.site)))
    for d in journal.new_dirs if journal else ():
        prune_dirs(t.path(d), t.package)
    return removed


# ------------------------------------------------------------------ status


def status(t: Target) -> dict:
    """Per transform and file: clean / patched / upstream / partial / drifted /
    reinstalled-since-patch / n/a; overall also interrupted or stale-state."""
    state = _state(t)
    doc = {"target": t.describe(), "state_dir": str(state.dir), "interrupted":
           state.has_journal()}
    try:
        saved = [state.load_journal() if doc["interrupted"] else None, state.load_manifest()]
        _check_bound(t, state, *saved)
        doc["interrupted"] = doc["interrupted"] or bool(state.leftovers(saved[1]))
    except PatchError as exc:
        if exc.code != DRIFT:
            raise
        return {**doc, "status": Status.STALE if "belongs to" in exc.message else
                Status.DRIFTED, "applied": [], "transforms": [], "problem": exc.message,
                "details": exc.details, "next": exc.hint}
    check_version(t)
    manifest = saved[1]
    recs = manifest.files if manifest else {}
    applied = manifest.applied if manifest else []
    rows = []
    transforms, _ = registry()
    for tr in transforms:
        fam = tr.family(t.base_version)
        if fam is None:
            rows.append({"transform": tr.name, "status": Status.NA, "files": []})
            continue
        files = []
        added = {a.path for a in fam.added}
        for rel in [e.path for e in fam.edits] + sorted(added):
            rec = recs.get(rel)
            st = file_state(t, rel, rec)
            if rel in added and rec is None and st == Status.MISSING:
                st = Status.CLEAN  # not added yet: what a clean install looks like
            elif fam.upstream and st in (Status.CLEAN, Status.PATCHED):
                st = Status.UPSTREAM  # the change ships with vLLM (patched: by others)
            elif tr.name not in applied and st == Status.PATCHED:
                st = Status.CLEAN  # written for another transform; this one is not in it
            files.append({"path": rel, "status": st})
        rows.append({"transform": tr.name, "files": files,
                     "status": _combine({f["status"] for f in files}, tr.name in applied)})
    seen = {r["status"] for r in rows}
    overall = next((s for s in (Status.DRIFTED, Status.REINSTALLED, Status.PARTIAL,
                                Status.PATCHED) if s in seen), Status.CLEAN)
    if doc["interrupted"]:
        overall = Status.INTERRUPTED
    doc.update(status=overall, applied=applied, transforms=rows)
    if overall in (Status.DRIFTED, Status.REINSTALLED, Status.PARTIAL):
        doc["next"] = ("`ddtree-patch revert` (add --force for drifted files), or "
                       + t.reinstall_hint())
    elif overall == Status.INTERRUPTED:
        doc["next"] = "`ddtree-patch recover` finishes or rolls back the interrupted run"
    return doc


def _combine(states: set[Status], applied: bool) -> Status:
    if Status.DRIFTED in states:
        return Status.DRIFTED
    if len(states) == 1:
        only = next(iter(states))
        if only == Status.MISSING:
            return Status.PARTIAL if applied else Status.DRIFTED
        return only
    if applied and states <= {Status.REINSTALLED, Status.MISSING}:
        return Status.REINSTALLED
    return Status.PARTIAL


def needs_action(st: dict) -> bool:
    return st["status"] not in (Status.CLEAN, Status.PATCHED, Status.UPSTREAM)


