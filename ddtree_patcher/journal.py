"""Write a plan as one transaction, and undo a run that died half-way.

Order: backups, then the journal (what each file was, its temp name, the folders the
run creates), then atomic replaces, then the manifest (the commit point), then the
journal goes.  A run killed anywhere is rolled back by ``rollback`` (the next run, or
``ddtree-patch recover``): it restores only files that hold what the run wrote, leaves
later edits alone (reported as drift), removes the run's temp files and the folders
it made.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import DRIFT, IO, TARGET, PatchError, interruption
from .fsops import (atomic_write, make_dirs, prune_dirs, remove_bytecode, remove_file,
                    sha256_bytes, sha256_file, temp_name, writable_problem)
from .manifest import Journal, JournalEntry, Manifest
from .plan import Plan
from .state import State, manifest_bytes
from .target import Target


def _fault(when: str, step: int) -> None:
    """Test hook: DDTREE_PATCH_FAULT=crash-after:N exits (no cleanup) once N files are
    written; fail-at:N raises an OSError before write N (0-based).  kill-at:N (any
    write point, fsops.point) is the SIGKILL one."""
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


def _new_dirs(t: Target, p: Plan) -> list[str]:
    out = set()
    for op in p.ops:
        if op.after is None:
            continue
        d = t.path(op.path).parent
        while not d.exists() and t.package in d.parents:
            out.add(d.relative_to(t.site).as_posix())
            d = d.parent
    return sorted(out, key=lambda s: (-s.count("/"), s))


def _keep(manifest: Manifest | None) -> set[str]:
    return {rel for rel, rec in (manifest.files.items() if manifest else ())
            if rec.kind == "modify"}


def execute(p: Plan, state: State, current: Manifest | None, op_name: str) -> bool:
    """Write a plan; on any error roll back and raise.  False: nothing to write (the
    manifest is not rewritten either)."""
    t = p.target
    if not p.ops and (p.manifest.same_content(current) if p.manifest else current is None):
        return False
    check_writable(t, [op.path for op in p.ops])
    state.check_inside(p.backups)
    state.ensure_writable()
    token = secrets.token_hex(4)
    if p.manifest is not None:
        p.manifest.updated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        p.manifest.run = token
    after = manifest_bytes(p.manifest)
    entries, befores = [], {}
    for i, op in enumerate(p.ops):
        name = f"before-{i}" if op.before is not None else None
        if name:
            befores[name] = op.before
        entries.append(JournalEntry(
            op.path, name, sha256_bytes(op.before) if op.before is not None else None,
            sha256_bytes(op.after) if op.after is not None else None,
            temp_name(t.path(op.path), token)))
    j = Journal(op_name, token, t.install(), entries, _new_dirs(t, p), state.manifest_sha(),
                sha256_bytes(after) if after is not None else None, os.getpid(), time.time(),
                sorted(p.backups))
    try:
        for rel, data in p.backups.items():
            state.save_backup(rel, data)
        state.save_journal(j, befores)
        for i, (op, e) in enumerate(zip(p.ops, entries)):
            _fault("before", i)
            path = t.path(op.path)
            if op.after is None:
                remove_file(path)
                prune_dirs(path.parent, t.package)
            else:
                make_dirs(path.parent, like_parent=True)
                atomic_write(path, op.after, tmp_name=e.tmp)
            if path.suffix == ".py":
                remove_bytecode(path)
            _fault("after", i + 1)
        state.save_manifest(p.manifest)
    except BaseException as exc:  # KeyboardInterrupt too: undo before leaving
        _undo(t, state, op_name, exc)
    state.clear_journal()
    state.prune_backups(_keep(p.manifest))
    state.tidy()
    return True


@contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM wait while a rollback runs (it must not stop half-way)."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    try:
        old = [signal.signal(s, signal.SIG_IGN) for s in sigs]
    except ValueError:  # not the main thread: signals are not ours to hold
        yield
        return
    try:
        yield
    finally:
        for s, h in zip(sigs, old):
            signal.signal(s, h)


def _undo(t: Target, state: State, op_name: str, exc: BaseException) -> None:
    code, why = interruption(exc) or (IO, f"{type(exc).__name__}: {exc}"
                                      if not isinstance(exc, OSError) else str(exc))
    try:
        with _signals_held():
            done = rollback(t, state)
    except Exception as again:
        raise PatchError(f"{op_name} failed while writing ({why}) and the rollback failed "
                         f"too ({again})", code, "fix the cause (disk full? permissions?), "
                         "then run `ddtree-patch recover`")
    if code != IO and done and done["action"] == "completed":
        raise PatchError(f"{op_name} {why} after its last write: the {op_name} is complete "
                         "and kept", code, "`ddtree-patch status` shows it"
                         + ("; `ddtree-patch verify` checks it" if op_name == "apply" else ""))
    n = len(done["restored"]) if done else 0
    if code != IO:
        raise PatchError(f"{op_name} {why} while writing; rolled back ({n} files restored)",
                         code, "run the command again")
    raise PatchError(f"{op_name} failed while writing ({why}); rolled back ({n} files "
                     "restored)", IO, "fix the cause (disk full? permissions?) and run the "
                     "command again")


def rollback(t: Target, state: State) -> dict | None:
    """Finish or undo the journaled run.  Returns what was done, or None (no journal).
    The caller holds the lock and has checked that the journal belongs to ``t``."""
    j = state.load_journal()
    if j is None:  # killed before its journal was written: nothing in vLLM changed
        left = state.leftovers(state.load_manifest())
        state.clean_temp()
        state.clear_journal()
        state.prune_backups(_keep(state.load_manifest()))
        state.tidy()
        return {"op": "run", "action": "state folder cleaned (nothing in vLLM was "
                "written)", "restored": [], "drift": [], "removed": left} if left else None
    _check_paths(t, state, j)
    for e in j.entries:
        remove_file(t.path(e.path).parent / e.tmp)
    state.clean_temp()
    now = state.manifest_sha()
    restored, drift = [], []
    if j.manifest_after_sha != j.manifest_before_sha and now == j.manifest_after_sha:
        action = "completed"  # the manifest is the commit point: every file was written
    elif now != j.manifest_before_sha:
        raise PatchError(f"the manifest in {state.dir} changed since the interrupted "
                         f"{j.op}: cannot tell which files to restore", DRIFT,
                         f"{state.reinstall_hint}, then `ddtree-patch forget`")
    else:
        action = "rolled back"
        for e in reversed(j.entries):
            path = t.path(e.path)
            cur = sha256_file(path)
            if cur == e.before_sha:
                continue  # never written, or already restored
            if cur != e.after_sha:
                drift.append({"path": e.path, "problem": "changed after the interrupted "
                              "run (left as it is)", "sha256": cur})
                continue
            if e.before is None:
                remove_file(path)
                prune_dirs(path.parent, t.package)
            else:
                data = state.read_before(e.before, e.before_sha)
                make_dirs(path.parent, like_parent=True)
                atomic_write(path, data, tmp_name=e.tmp)
            if path.suffix == ".py":
                remove_bytecode(path, emptied=True)  # a kill may have left it empty
            restored.append(e.path)
        for d in j.new_dirs:
            prune_dirs(t.path(d), t.package)
    state.clear_journal()
    state.prune_backups(_keep(state.load_manifest()))
    state.tidy()
    return {"op": j.op, "action": action, "restored": restored, "drift": drift}


def _check_paths(t: Target, state: State, j: Journal) -> None:
    """Before a journal is acted on: each of its paths, links resolved, stays in vllm/
    (the names themselves were checked when it was read)."""
    bad = [rel for rel in [e.path for e in j.entries] + j.new_dirs if not t.contains(rel)]
    if bad:
        raise PatchError(f"the journal in {state.journal_dir} names paths that lead outside "
                         f"{t.package} (through a link): ddtree-patch does not follow them; "
                         "nothing was done", DRIFT, f"{state.reinstall_hint}, then "
                         "`ddtree-patch forget`", details=bad)


def leftovers(t: Target, j: Journal | None, manifest: Manifest | None) -> list[Path]:
    """Files in the tree that hold ddtree-patch's own bytes and that no RECORD lists:
    what it added (manifest, journal), and temp files of a killed run.  Paths that lead
    out of vllm/ (through a link) are never opened."""
    want = [(rel, rec.post_sha) for rel, rec in (manifest.files.items() if manifest else ())
            if rec.kind == "add"]
    for e in j.entries if j else ():
        want.append((str(Path(e.path).parent / e.tmp), None))  # any bytes: a temp file
        if e.before is None and e.after_sha:
            want.append((e.path, e.after_sha))
    return sorted({t.path(rel) for rel, sha in want if t.contains(rel) and (
        sha256_file(t.path(rel)) == sha if sha else t.path(rel).is_file())})
