"""The kill -9 harness (run by test_kill_harness.py in a fresh interpreter).

Every ddtree-patch command runs as the real CLI (``cli.main``) in a forked child; the
engine SIGKILLs itself at write point N (``DDTREE_PATCH_FAULT=kill-at:N``, one point
after every durable change: temp file written, file replaced or removed, folder made
or removed, bytecode removed, backup / journal / manifest written, journal cleared).
For every N until the command completes:

  * at the kill: every file in the tree holds pristine bytes or bytes the run writes
    (or is one of its temp files): nothing foreign;
  * then the tool's own advice is followed (``status`` -> the command in its ``next:``
    line, until it is clean or patched; patched -> ``revert``);
  * then the tree must be the pristine release again: same files, same bytes (only
    bytecode of touched modules may be gone), same folders, nothing unlisted; the
    state folder holds nothing.

Scenarios on a real vLLM 0.20.2 tree (slim: its Python files and dist-info):
apply (--only ddtree-proposer: 4 edits, 16 added files in 2 new folders), revert,
recover after a killed apply, recover after a killed revert, and a sample of killed
applies followed by an in-place upgrade to 0.33.0 (old bytes must never be written
into it; ``forget`` must leave the pristine 0.33.0 tree).  Then (issue #30) kills at
the bytecode points of a tree byte-compiled at run time (no empty ``__pycache__`` may
be left), and SIGINT / SIGTERM at every 3rd write point of apply (exit 130 / 143, the
run rolled back before it ends).

Forks keep this fast; the transforms' output is computed once (a memo of the pure
``plan.compose``), everything else runs for real each time.

    python kill_driver.py WORKDIR [scenario ...]   -> one JSON document on stdout
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from wheels import copy_tree, upgrade_in_place  # noqa: E402

from ddtree_patcher import cli, engine, fsops  # noqa: E402
from ddtree_patcher import plan as planmod  # noqa: E402
from ddtree_patcher.target import find_target  # noqa: E402
from ddtree_patcher.verify.integrity import record_problems  # noqa: E402

ONLY = ["--only", "ddtree-proposer"]
ADVICE = re.compile(r"`ddtree-patch ([a-z]+)((?: --[a-z-]+)*)`")


# ------------------------------------------------------------------ running commands


def run(args: list[str], site: Path, env: dict | None = None) -> dict:
    """ddtree-patch ARGS --site-packages SITE in a forked child."""
    out_path, err_path = WORK / "out.txt", WORK / "err.txt"
    pid = os.fork()
    if pid == 0:  # the child: the real CLI, then _exit with its code
        code = 98
        try:
            fsops._points[0] = 0
            os.environ.update(env or {})
            for fd, path in ((1, out_path), (2, err_path)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(f, fd)
                os.close(f)
            try:
                cli.main([*args, "--site-packages", str(site)])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 99
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    return {"args": args, "code": None if killed else os.WEXITSTATUS(status),
            "killed": killed, "out": out_path.read_text(), "err": err_path.read_text()}


def points(args: list[str], site: Path) -> list[str]:
    """The write points of one complete run (its log), the run itself included."""
    log = WORK / "points.log"
    log.unlink(missing_ok=True)
    r = run(args, site, {"DDTREE_PATCH_FAULT_LOG": str(log)})
    assert r["code"] == 0, r
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines()]


# ------------------------------------------------------------------ the tree


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


class Tree:
    """A working copy and its pristine twin (never touched: the reference)."""

    def __init__(self, name: str, version: str, prepare=None):
        self.site = WORK / name
        self.ref = WORK / f"{name}.ref"
        shutil.rmtree(self.site, ignore_errors=True)
        for root in ([self.ref] if not self.ref.exists() else []) + [self.site]:
            copy_tree("vllm", version, root, slim=True)
            if prepare:
                prepare(root)
        self.pristine = {rel: sha(self.ref / rel) for rel in files(self.ref)}
        self.dirs = dirs(self.ref)
        self.stat = {rel: stat(self.site / rel) for rel in self.pristine}

    def reset_bytecode(self) -> None:
        """Put back the bytecode ddtree-patch removed (it removes it on purpose): every
        trial starts from the pristine release, so every run has the same points."""
        for rel in self.pristine:
            if "/__pycache__/" in rel and not (self.site / rel).exists():
                (self.site / rel).parent.mkdir(exist_ok=True)
                shutil.copy2(self.ref / rel, self.site / rel)
                self.stat[rel] = stat(self.site / rel)

    def changed(self) -> dict[str, str | None]:
        """Files whose bytes differ from pristine (None: gone), and new files."""
        out = {}
        cur = files(self.site)
        for rel in set(cur) | set(self.pristine):
            if rel not in cur:
                out[rel] = None
            elif rel not in self.pristine or stat(self.site / rel) != self.stat[rel]:
                h = sha(self.site / rel)
                if h != self.pristine.get(rel):
                    out[rel] = h
        return out

    def problems(self) -> list[str]:
        """What keeps the tree from being the pristine release."""
        bad = []
        for rel, h in sorted(self.changed().items()):
            if h is None and "/__pycache__/" in rel:
                continue  # bytecode of a touched module, removed on purpose
            bad.append(f"{rel}: " + ("missing" if h is None else "new" if rel not in
                                     self.pristine else "differs"))
        extra = dirs(self.site) - self.dirs
        bad += [f"{d}/: folder not in the release" for d in sorted(extra)]
        return bad


def files(root: Path) -> set[str]:
    out = set()
    for r, _, names in os.walk(root):
        out.update(os.path.relpath(os.path.join(r, n), root) for n in names)
    return out


def dirs(root: Path) -> set[str]:
    return {os.path.relpath(r, root) for r, _, _ in os.walk(root)}


def stat(p: Path) -> tuple:
    st = os.stat(p)
    return st.st_ino, st.st_size, st.st_mtime_ns


def state_files() -> list[str]:
    return sorted(str(p.relative_to(STATE)) for p in STATE.rglob("*") if p.is_file())


# ------------------------------------------------------------------ checks


def foreign(tree: Tree, allowed: set[str]) -> list[str]:
    """Files whose bytes are neither pristine nor written by the run (temp files of the
    run are fine: they are journaled and go on recovery)."""
    return [rel for rel, h in tree.changed().items() if h is not None
            and h not in allowed and not rel.endswith(fsops.TMP_SUFFIX)]


def follow_advice(site: Path) -> list[dict]:
    """status -> the ddtree-patch command in its next: line, until clean (patched ->
    revert).  Every command on the way must succeed."""
    steps = []
    for _ in range(6):
        st = run(["status", "--json"], site)
        steps.append(st)
        doc = json.loads(st["out"])
        if st["code"] == 0:
            if doc["status"] == "patched":
                steps.append(run(["revert", "--json"], site))
                assert steps[-1]["code"] == 0, steps
                continue
            assert doc["status"] == "clean", steps
            return steps
        m = ADVICE.search(doc.get("next", ""))
        assert st["code"] == 4 and m, steps
        steps.append(run([m.group(1), *m.group(2).split(), "--json"], site))
        assert steps[-1]["code"] == 0, steps
    raise AssertionError(f"the advice did not lead back to a clean tree: {steps}")


def trial(tree: Tree, label: str, allowed: set[str]) -> dict | None:
    """After a kill: nothing foreign, advice followed, pristine.  None when all hold."""
    bad = foreign(tree, allowed)
    steps = []
    try:
        steps = follow_advice(tree.site)
    except AssertionError as exc:
        return {"at": label, "problem": f"advice: {exc}"[:3000]}
    bad += tree.problems()
    if state_files():
        bad.append(f"state left: {state_files()}")
    if any("Traceback" in s["err"] for s in steps):
        bad.append("a traceback")
    return {"at": label, "problem": bad[:10],
            "advice": [s["args"][0] for s in steps]} if bad else None


# ------------------------------------------------------------------ scenarios


def patched_bytes(site: Path) -> set[str]:
    t = find_target(site_packages=str(site))
    p = engine.dry_run(t, ["ddtree-proposer"])
    return {hashlib.sha256(op.after).hexdigest() for op in p.ops if op.after is not None}


def scenario_apply(tree: Tree, allowed: set[str]) -> dict:
    tree.reset_bytecode()
    labels = points(["apply", "--no-verify", *ONLY], tree.site)
    assert not follow_advice(tree.site)[-1]["code"] and not tree.problems()
    fails = []
    for n, label in enumerate(labels, 1):
        tree.reset_bytecode()
        r = run(["apply", "--no-verify", *ONLY], tree.site, {"DDTREE_PATCH_FAULT": f"kill-at:{n}"})
        assert r["killed"], (n, label, r)
        fails.append(trial(tree, f"{n} {label}", allowed))
    return {"points": labels, "failures": [f for f in fails if f]}


def scenario_revert(tree: Tree, allowed: set[str]) -> dict:
    tree.reset_bytecode()
    run(["apply", "--no-verify", *ONLY], tree.site)
    labels = points(["revert"], tree.site)
    fails = []
    for n, label in enumerate(labels, 1):
        tree.reset_bytecode()
        assert run(["apply", "--no-verify", *ONLY], tree.site)["code"] == 0
        r = run(["revert"], tree.site, {"DDTREE_PATCH_FAULT": f"kill-at:{n}"})
        assert r["killed"], (n, label, r)
        fails.append(trial(tree, f"{n} {label}", allowed))
    return {"points": labels, "failures": [f for f in fails if f]}


def _middle(labels: list[str], site: Path) -> int:
    """A kill point half-way through the target writes."""
    writes = [i for i, lab in enumerate(labels, 1)
              if lab.startswith("replaced ") and str(site) in lab]
    return writes[len(writes) // 2]


def scenario_recover(tree: Tree, allowed: set[str], after: str) -> dict:
    tree.reset_bytecode()
    if after == "apply":
        setup = ["apply", "--no-verify", *ONLY]
        labels = points(setup, tree.site)
        follow_advice(tree.site)
    else:
        run(["apply", "--no-verify", *ONLY], tree.site)
        setup = ["revert"]
        labels = points(setup, tree.site)
    k = _middle(labels, tree.site)

    def crash():
        tree.reset_bytecode()
        if after == "revert":
            assert run(["apply", "--no-verify", *ONLY], tree.site)["code"] == 0
        assert run(setup, tree.site, {"DDTREE_PATCH_FAULT": f"kill-at:{k}"})["killed"]

    crash()
    rec = points(["recover"], tree.site)
    follow_advice(tree.site)
    fails = []
    for n, label in enumerate(rec, 1):
        crash()
        r = run(["recover"], tree.site, {"DDTREE_PATCH_FAULT": f"kill-at:{n}"})
        assert r["killed"], (n, label, r)
        fails.append(trial(tree, f"{n} {label}", allowed))
    return {"points": rec, "crashed_at": labels[k - 1], "failures": [f for f in fails if f]}


def runtime_bytecode(root: Path) -> None:
    """A `pip install --no-compile` tree (no bytecode, RECORD lists none) in which vLLM
    then byte-compiled only the modules ddtree-proposer edits: each .pyc is the only
    file of its __pycache__, which apply empties and so removes."""
    import py_compile

    for d in list(root.rglob("__pycache__")):
        shutil.rmtree(d)
    record = next(root.glob("*.dist-info")) / "RECORD"
    record.write_text("".join(line for line in record.read_text().splitlines(True)
                              if ".pyc," not in line))
    _, by_name = planmod.registry()
    for e in by_name["ddtree-proposer"].family("0.20.2").edits:
        py_compile.compile(str(root / e.path), doraise=True)


def scenario_bytecode(allowed: set[str]) -> dict:
    """kill -9 at every bytecode point of apply in a tree whose touched modules were
    byte-compiled at run time: the advice ends RECORD-clean (no empty __pycache__)."""
    tree = Tree("byte", "0.20.2", prepare=runtime_bytecode)
    allowed = allowed | set(tree.pristine.values())
    labels = points(["apply", "--no-verify", *ONLY], tree.site)
    follow_advice(tree.site)
    picks = [n for n, lab in enumerate(labels, 1)
             if lab.startswith("bytecode removed") or lab.endswith("/__pycache__")]
    fails = []
    for n in picks:
        tree.reset_bytecode()
        r = run(["apply", "--no-verify", *ONLY], tree.site, {"DDTREE_PATCH_FAULT": f"kill-at:{n}"})
        assert r["killed"], (n, r)
        bad = trial(tree, f"{n} {labels[n - 1]}", allowed)
        record = record_problems(tree.site, next(tree.site.glob("*.dist-info")))
        if bad or record:
            fails.append({**(bad or {"at": f"{n} {labels[n - 1]}"}), "record": record[:5]})
    return {"points": [labels[n - 1] for n in picks], "failures": fails}


def scenario_signals(tree: Tree, allowed: set[str]) -> dict:
    """SIGINT / SIGTERM at every 3rd write point of apply: the run rolls back before it
    ends (exit 130 / 143; the pristine tree and no state at once when the signal came
    before the commit point), then the advice leads back to the pristine release."""
    tree.reset_bytecode()
    labels = points(["apply", "--no-verify", *ONLY], tree.site)
    follow_advice(tree.site)
    commit = next(i for i, lab in enumerate(labels, 1) if lab.endswith("/manifest.json"))
    fails = []
    for n in range(1, len(labels) + 1, 3):
        for sig, code in (("INT", 130), ("TERM", 143)):
            tree.reset_bytecode()
            r = run(["apply", "--no-verify", *ONLY], tree.site,
                    {"DDTREE_PATCH_FAULT": f"signal-at:{n}:{sig}"})
            at = f"{n} {labels[n - 1]} ({sig})"
            bad = [] if r["code"] == code and "next: " in r["err"] else [
                f"exit {r['code']}: {r['err'][-300:]}"]
            if n < commit and (tree.problems() or state_files()):
                bad.append(f"not rolled back at once: {tree.problems()[:3]} {state_files()}")
            done = trial(tree, at, allowed)
            if bad or done:
                fails.append({"at": at, "problem": bad + [done]})
    return {"points": labels, "commit": commit, "failures": fails}


def scenario_upgrade(allowed: set[str]) -> dict:
    """A killed apply (sampled points, and a complete one), then vLLM upgraded in place
    to 0.33.0: every command refuses and writes nothing, status says what to do, and
    that (forget) leaves exactly the pristine 0.33.0 release."""
    base = Tree("upg", "0.20.2")
    labels = points(["apply", "--no-verify", *ONLY], base.site)
    journal = next(i for i, lab in enumerate(labels, 1) if lab.endswith("journal.json"))
    first = next(i for i, lab in enumerate(labels, 1) if lab.startswith("temp written")
                 and str(base.site) in lab)
    picks = sorted({journal, first, _middle(labels, base.site), len(labels) - 1}) + [None]
    fails, tried = [], []
    for n in picks:
        tree = Tree("upg", "0.20.2")
        if n is None:  # a complete apply
            assert run(["apply", "--no-verify", *ONLY], tree.site)["code"] == 0
        else:
            r = run(["apply", "--no-verify", *ONLY], tree.site,
                    {"DDTREE_PATCH_FAULT": f"kill-at:{n}"})
            assert r["killed"]
        upgrade_in_place(tree.site, "vllm", "0.33.0", slim=True)
        new = Tree.__new__(Tree)  # the upgraded tree against the pristine 0.33.0
        new.site, new.ref = tree.site, WORK / "v033.ref"
        if not new.ref.exists():
            copy_tree("vllm", "0.33.0", new.ref, slim=True)
        new.pristine = {rel: sha(new.ref / rel) for rel in files(new.ref)}
        new.dirs = dirs(new.ref)
        new.stat = {rel: (None,) for rel in new.pristine}
        before = {rel: sha(tree.site / rel) for rel in files(tree.site)}
        problems = []
        journaled = any(STATE.rglob("journal.json"))
        for args in (["revert", "--force"], ["recover"], ["apply", "--no-verify"], ["revert"]):
            r = run(args, tree.site)
            if args == ["recover"] and not journaled:
                ok = r["code"] == 0  # nothing to recover
            else:
                ok = r["code"] == 4 and "next:" in r["err"] and "forget" in r["err"]
            if not ok:
                problems.append(f"{args}: exit {r['code']}: {r['err'][-300:]}")
        after = {rel: sha(tree.site / rel) for rel in files(tree.site)}
        if after != before:
            problems.append("a refused command changed the tree: "
                            + str(sorted(k for k in set(after) | set(before)
                                         if after.get(k) != before.get(k))[:5]))
        try:
            steps = follow_advice(tree.site)
        except AssertionError as exc:
            steps, problems = [], problems + [f"advice: {str(exc)[:2000]}"]
        problems += new.problems()
        old = set(allowed) - set(new.pristine.values())
        problems += [f"{rel}: holds bytes the 0.20.2 run wrote" for rel in files(tree.site)
                     if sha(tree.site / rel) in old]
        bad_record = record_problems(tree.site, next(tree.site.glob("*.dist-info")))
        problems += [f"RECORD: {b}" for b in bad_record]
        if state_files():
            problems.append(f"state left: {state_files()}")
        tried.append({"at": "complete" if n is None else labels[n - 1],
                      "advice": [s["args"][0] for s in steps]})
        if problems:
            fails.append({"at": tried[-1]["at"], "problem": problems[:10]})
    return {"tried": tried, "failures": fails}


def main() -> None:
    global WORK, STATE
    WORK = Path(sys.argv[1])
    STATE = WORK / "state"
    os.environ["DDTREE_PATCH_STATE_DIR"] = str(STATE)
    STATE.mkdir(parents=True, exist_ok=True)
    os.environ.pop("DDTREE_PATCH_FAULT", None)
    wanted = sys.argv[2:] or ["apply", "revert", "recover-apply", "recover-revert",
                              "upgrade", "bytecode", "signals"]
    memo, compose = {}, planmod.compose

    def memo_compose(t, src, families):
        key = (t.base_version, tuple(tr.name for tr, _ in families),
               tuple(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in src.pristine.items())))
        if key not in memo:
            memo[key] = compose(t, src, families)
        return copy.deepcopy(memo[key])

    planmod.compose = memo_compose
    tree = Tree("site", "0.20.2")
    assert record_problems(tree.ref, next(tree.ref.glob("*.dist-info"))) == []
    allowed = set(tree.pristine.values()) | patched_bytes(tree.site)
    out = {}
    for name in wanted:
        if name == "apply":
            out[name] = scenario_apply(tree, allowed)
        elif name == "revert":
            out[name] = scenario_revert(tree, allowed)
        elif name.startswith("recover-"):
            out[name] = scenario_recover(tree, allowed, name.split("-", 1)[1])
        elif name == "upgrade":
            out[name] = scenario_upgrade(allowed)
        elif name == "bytecode":
            out[name] = scenario_bytecode(allowed)
        elif name == "signals":
            out[name] = scenario_signals(tree, allowed)
    out["record_problems"] = record_problems(tree.site, next(tree.site.glob("*.dist-info")))
    print(json.dumps(out))


WORK = STATE = Path()

if __name__ == "__main__":
    main()
