"""The ddtree-patch command line: apply, revert, status, list, verify, recover.

Exit codes: 0 ok; 1 changes pending (apply --dry-run) or a verify check failed;
2 bad input; 3 target problem (no vLLM, editable, read-only); 4 drift / needs action;
5 locked; 6 transform failed (nothing written); 7 write failed (rolled back);
8 verify failed after apply (reverted).
"""

from __future__ import annotations

import functools
import sys

import click

from . import __version__, engine, output
from .errors import DRIFT, OK, PENDING, VERIFY, PatchError
from .state import State
from .target import check_version, find_target, record_mismatches
from .versions import SUPPORTED


def target_options(fn):
    @click.option("--python", "python", metavar="PATH",
                  help="Interpreter of the environment to patch (default: this one).")
    @click.option("--site-packages", "site_packages", metavar="DIR",
                  help="A bare site-packages tree holding vllm/ and its dist-info.")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def run(command: str, as_json: bool, body):
    """Run a command body that returns (exit_code, payload, text); map errors."""
    try:
        code, payload, text = body()
    except PatchError as err:
        if as_json:
            output.emit_json(command, err.code, {"error": err.to_dict()})
        else:
            output.emit_error(err)
        sys.exit(err.code)
    if as_json:
        output.emit_json(command, code, payload)
    elif text:
        click.echo(text)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddtree-patch")
def main():
    """Add DDTree tree speculative decoding to an installed vLLM, verify it, revert it."""


def _recover_note(t, state) -> str:
    done = engine.recover(t, state)
    if not done:
        return ""
    return (f"recovered an interrupted {done['op']}: {done['action']}"
            + (f" ({len(done['restored'])} files restored)" if done["restored"] else "") + "\n")


@main.command()
@click.option("--vllm-version", metavar="X", help="Expected vLLM version (default: detected).")
@click.option("--only", multiple=True, metavar="NAME", help="Apply only this transform.")
@click.option("--skip", multiple=True, metavar="NAME", help="Leave this transform out.")
@click.option("--dry-run", is_flag=True, help="Print the unified diff; exit 1 if changes "
              "are pending.")
@click.option("--no-verify", is_flag=True, help="Do not run `verify --quick` afterwards.")
@click.option("--full-verify", is_flag=True, help="Run the full verify (engine check "
              "included) afterwards instead of --quick.")
@click.option("--keep-on-failure", is_flag=True,
              help="Keep the patched files when verify fails (for debugging).")
@target_options
def apply(vllm_version, only, skip, dry_run, no_verify, full_verify, keep_on_failure,
          python, site_packages, as_json):
    """Apply the transforms for the installed vLLM version."""

    def body():
        names = engine.resolve_names(only, skip)
        output.progress("finding vLLM")
        t = find_target(python, site_packages)
        check_version(t, vllm_version)
        state = State(t.key)
        if dry_run:
            p = engine.plan(t, state, _wanted(state, names))
            diff = p.diff(color=output.color_ok())
            code = PENDING if p.changes else OK
            text = diff or "nothing to change"
            return code, {"target": t.describe(), "changes": p.changes,
                          "transforms": p.transforms, "diff": p.diff(),
                          "files": [op.path for op in p.ops]}, text.rstrip("\n")
        with state.lock():
            note = _recover_note(t, state)
            output.progress("computing the patch in memory")
            p = engine.plan(t, state, _wanted(state, names))
            output.progress(f"writing {len(p.ops)} files")
            engine.execute(p, state, "apply")
        lines = [note.rstrip()] if note else []
        for name, info in p.transforms.items():
            lines.append(f"{name}: {info['status']}" + (f" ({info['note']})"
                                                        if info.get("note") else ""))
        lines.append(f"{len(p.ops)} files written" if p.ops else
                     "already up to date: nothing written")
        payload = {"target": t.describe(), "transforms": p.transforms,
                   "files": [op.path for op in p.ops], "applied": p.wanted}
        if p.ops and not no_verify and p.manifest is not None:
            from .verify_client import run_verify
            report = run_verify(t, quick=not full_verify)
            payload["verify"] = report
            lines.append(report["summary"])
            if not report["ok"]:
                if keep_on_failure:
                    raise PatchError("verify failed after apply; patched files kept "
                                     "(--keep-on-failure)", VERIFY,
                                     "inspect, then `ddtree-patch revert`",
                                     details=report["failed"])
                with state.lock():
                    back = engine.plan(t, state, [])
                    engine.execute(back, state, "revert")
                raise PatchError("verify failed after apply; the patch was reverted", VERIFY,
                                 "report `ddtree-patch apply --keep-on-failure --json` "
                                 "output as a bug", details=report["failed"])
        return OK, payload, "\n".join(lines)

    run("apply", as_json, body)


def _wanted(state: State, names: list[str]) -> list[str]:
    manifest = state.load_manifest()
    already = manifest["applied"] if manifest else []
    return list(dict.fromkeys(already + names))


@main.command()
@click.option("--only", multiple=True, metavar="NAME", help="Revert only this transform.")
@click.option("--force", is_flag=True, help="Also restore files edited since the patch.")
@target_options
def revert(only, force, python, site_packages, as_json):
    """Put back the pristine files, byte for byte, and check vLLM's RECORD."""

    def body():
        if only:
            engine.resolve_names(only, ())
        t = find_target(python, site_packages)
        state = State(t.key)
        with state.lock():
            note = _recover_note(t, state)
            manifest = state.load_manifest()
            applied = manifest["applied"] if manifest else []
            drop = engine.with_dependents(only) if only else set(applied)
            wanted = [n for n in applied if n not in drop]
            p = engine.plan(t, state, wanted, force=force)
            engine.execute(p, state, "revert")
        bad = record_mismatches(t) if not wanted else []
        payload = {"target": t.describe(), "files": [op.path for op in p.ops],
                   "applied": wanted, "record_mismatches": bad}
        text = note + (f"{len(p.ops)} files restored" if p.ops else "nothing to revert")
        if bad:
            raise PatchError(f"after revert {len(bad)} files still differ from vLLM's RECORD "
                             "(not files ddtree-patch wrote)", DRIFT,
                             engine._reinstall_hint(t), details=bad[:20])
        if not wanted:
            text += "\nRECORD check: every file matches"
        return OK, payload, text

    run("revert", as_json, body)


@main.command()
@target_options
def status(python, site_packages, as_json):
    """Per transform and file: clean, patched, upstream, partial, drifted, or
    reinstalled-since-patch."""

    def body():
        t = find_target(python, site_packages)
        st = engine.status(t, State(t.key))
        rows = []
        for r in st["transforms"]:
            if not r["files"]:
                rows.append([r["transform"], r["status"], "", ""])
            for f in r["files"]:
                rows.append([r["transform"], r["status"], f["path"], f["status"]])
        text = (f"{t.dist} {t.version} at {t.site}\nstatus: {st['status']}\n\n"
                + output.table(rows, ["transform", "status", "file", "file status"]))
        if st["interrupted"]:
            text += "\n\nan interrupted run was found: the next apply/revert (or " \
                    "`ddtree-patch recover`) rolls it back"
        code = OK if st["status"] in ("clean", "patched", "upstream") else DRIFT
        if code and not st["interrupted"]:
            text += "\n\nnext: `ddtree-patch revert` (add --force for drifted files), or " \
                    + engine._reinstall_hint(t)
        return code, st, text

    run("status", as_json, body)


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def list_cmd(as_json):
    """Transforms x supported versions, and what each does."""

    def body():
        from .patches import TRANSFORMS
        rows, doc = [], []
        for tr in TRANSFORMS:
            cells = []
            per = {}
            for v in SUPPORTED:
                fam = tr.family(v)
                cell = "-" if fam is None else ("upstream" if fam.upstream else "patch")
                cells.append(cell)
                per[v] = cell
            rows.append([tr.name] + cells)
            doc.append({"name": tr.name, "summary": tr.summary, "reference": tr.reference,
                        "versions": per})
        text = output.table(rows, ["transform"] + list(SUPPORTED)) + "\n\n" + "\n".join(
            f"{tr.name}: {tr.summary}" + (f" ({tr.reference})" if tr.reference else "")
            for tr in TRANSFORMS)
        return OK, {"supported_versions": list(SUPPORTED), "transforms": doc}, text

    run("list", as_json, body)


@main.command()
@target_options
def recover(python, site_packages, as_json):
    """Finish or roll back a run that was interrupted."""

    def body():
        t = find_target(python, site_packages)
        state = State(t.key)
        with state.lock():
            done = engine.recover(t, state)
        text = "nothing to recover" if not done else _recover_line(done)
        return OK, {"target": t.describe(), "recovered": done}, text

    run("recover", as_json, body)


def _recover_line(done: dict) -> str:
    return f"interrupted {done['op']}: {done['action']} ({len(done['restored'])} files restored)"


@main.command()
@click.option("--quick", is_flag=True, help="Skip the engine run (integrity, imports, "
              "kernels only).")
@click.option("--seed", type=int, default=None, help="Seed of the random kernel inputs "
              "(default: fresh each run).")
@target_options
def verify(quick, seed, python, site_packages, as_json):
    """Smoke-test the patched vLLM in a fresh interpreter of its environment."""

    def body():
        from .verify_client import format_report, run_verify
        t = find_target(python, site_packages)
        report = run_verify(t, quick=quick, seed=seed)
        code = OK if report["ok"] else PENDING
        text = format_report(report, t)
        return code, report, text

    run("verify", as_json, body)


if __name__ == "__main__":
    main()
