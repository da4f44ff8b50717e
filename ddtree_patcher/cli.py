"""The ddtree-patch command line: it parses and prints; ``engine`` decides.

Every failure exits with a documented code (``errors.CODES``) and a ``next:`` line on
stderr; with ``--json`` every outcome, usage errors included, is one JSON document.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import traceback

import click

from . import __version__, engine, output
from .errors import (CODES, DRIFT, INTERNAL, INTERRUPTED, OK, PENDING, USAGE, PatchError,
                     Terminated, interruption)
from .manifest import Action
from .target import find_target
from .versions import SUPPORTED

EPILOG = "Exit codes:\n\n" + "\n\n".join(f"{c}: {m}" for c, m in CODES.items())


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


def fail(command: str, as_json: bool, err: PatchError) -> None:
    if as_json:
        output.emit_json(command, err.code, {"error": err.to_dict()})
    else:
        output.emit_error(err)
    sys.exit(err.code)


def run(command: str, as_json: bool, body):
    """Run a command body that returns (exit_code, payload, text, next_hint)."""
    try:
        code, payload, text, hint = body()
    except PatchError as err:
        fail(command, as_json, err)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # a bug: say so, without a traceback unless asked
        if os.environ.get("DDTREE_PATCH_DEBUG"):
            traceback.print_exc()
        fail(command, as_json, PatchError(
            f"internal error: {type(exc).__name__}: {exc}", INTERNAL,
            "this is a bug: rerun with DDTREE_PATCH_DEBUG=1 and report the traceback; "
            "`ddtree-patch status` tells whether a `recover` is needed"))
    if as_json:
        output.emit_json(command, code, {**payload, **({"next": hint} if hint else {})})
    else:
        if text:
            click.echo(text)
        if hint:
            output.emit_next(hint)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(__version__, prog_name="ddtree-patch")
def cli():
    """Add DDTree tree speculative decoding to an installed vLLM, verify it, revert it."""


def _recover_line(done: dict | None) -> str:
    if not done:
        return ""
    return (f"recovered an interrupted {done['op']}: {done['action']}"
            + (f" ({len(done['restored'])} files restored)" if done["restored"] else ""))


@cli.command()
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
        names, pulled = engine.resolve_names(only, skip)
        output.progress("finding vLLM")
        t = find_target(python, site_packages)
        if dry_run:
            p = engine.dry_run(t, names, vllm_version)
            return (PENDING if p.changes else OK,
                    {"target": t.describe(), "changes": p.changes, "transforms": p.transforms,
                     "diff": p.diff(), "files": [op.path for op in p.ops]},
                    (p.diff(color=output.color_ok()) or "nothing to change").rstrip("\n"),
                    "run it without --dry-run to write these changes" if p.changes else "")
        output.progress("computing the patch in memory, then writing it")
        mode = None if no_verify else ("full" if full_verify else "quick")
        out = engine.apply(t, names, mode, keep_on_failure, vllm_version)
        p = out.plan
        for name, why in pulled.items():
            p.transforms.setdefault(name, {})["needed_by"] = why
        lines = [_recover_line(out.recovered)] if out.recovered else []
        for name, info in p.transforms.items():
            extra = [x for x in (info.get("note"), info.get("needed_by")) if x]
            lines.append(f"{name}: {info['status']}" + (f" ({'; '.join(extra)})"
                                                        if extra else ""))
        lines.append(f"{len(p.ops)} files written" if out.wrote and p.ops else
                     "already up to date: nothing written")
        if out.missing:
            lines.append(f"note: {engine.lacks(out.missing)}: the install, not ddtree-patch, "
                         "is incomplete (a slim image?); the files ddtree-patch edits are "
                         "intact, so it patched; verify's and revert's RECORD checks report "
                         "the same files as missing before ddtree-patch and still fail on "
                         "any other")
        payload = {"target": t.describe(), "transforms": p.transforms,
                   "files": [op.path for op in p.ops] if out.wrote else [],
                   "applied": p.wanted, "recovered": out.recovered,
                   "missing_before": out.missing}
        if out.verify:
            payload["verify"] = out.verify
            lines.append(out.verify["summary"])
        elif out.wrote and p.ops and p.manifest is not None:
            lines.append("not verified (--no-verify): run `ddtree-patch verify`")
        return OK, payload, "\n".join(lines), ""

    run("apply", as_json, body)


@cli.command()
@click.option("--only", multiple=True, metavar="NAME", help="Revert only this transform "
              "(and the ones built on it).")
@click.option("--force", is_flag=True, help="Also restore files edited since the patch.")
@target_options
def revert(only, force, python, site_packages, as_json):
    """Put back the pristine files, byte for byte, and check vLLM's RECORD."""

    def body():
        engine.resolve_names(only, ())  # unknown names are an error
        t = find_target(python, site_packages)
        out = engine.revert(t, only, force)
        p, bad = out.plan, out.record_mismatches
        if bad:
            raise PatchError(f"after revert {len(bad)} files still differ from vLLM's RECORD "
                             "or are not listed in it (not files ddtree-patch wrote)", DRIFT,
                             t.reinstall_hint(), details=bad[:20])
        lines = [_recover_line(out.recovered)] if out.recovered else []
        lines.append(f"{len(p.ops)} files restored" if p.ops else "nothing to revert")
        if not p.wanted:
            lines.append("RECORD check: " + (
                f"{len(out.missing)} files RECORD lists are missing, as they were before "
                "ddtree-patch applied (the install is incomplete); every other file "
                "matches" if out.missing else "every file matches") + ", no unlisted files")
        payload = {"target": t.describe(), "files": [op.path for op in p.ops],
                   "applied": p.wanted, "record_mismatches": bad, "recovered": out.recovered,
                   "missing_before": out.missing}
        return OK, payload, "\n".join(lines), ""

    run("revert", as_json, body)


@cli.command()
@target_options
def status(python, site_packages, as_json):
    """Per transform and file: clean, patched, upstream, partial, drifted, or
    reinstalled-since-patch (overall also interrupted or stale-state)."""

    def body():
        t = find_target(python, site_packages)
        st = engine.status(t)
        rows = []
        for r in st["transforms"]:
            if not r["files"]:
                rows.append([r["transform"], r["status"], "", ""])
            for f in r["files"]:
                rows.append([r["transform"], r["status"], f["path"], f["status"]])
        text = f"{t.dist} {t.version} at {t.site}\nstatus: {st['status']}"
        if st.get("problem"):
            text += f"\n{st['problem']}"
        if rows:
            text += "\n\n" + output.table(rows, ["transform", "status", "file", "file status"])
        code = DRIFT if engine.needs_action(st) else OK
        return code, st, text, st.pop("next", "")

    run("status", as_json, body)


@cli.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def list_cmd(as_json):
    """Transforms x supported versions, and what each does."""

    def body():
        from .patches import TRANSFORMS
        rows, doc = [], []
        for tr in TRANSFORMS:
            per = {}
            for v in SUPPORTED:
                fam = tr.family(v)
                per[v] = "-" if fam is None else (Action.UPSTREAM.value if fam.upstream
                                                  else "patch")
            rows.append([tr.name] + list(per.values()))
            doc.append({"name": tr.name, "summary": tr.summary, "reference": tr.reference,
                        "versions": per})
        text = output.table(rows, ["transform"] + list(SUPPORTED)) + "\n\n" + "\n".join(
            f"{tr.name}: {tr.summary}" + (f" ({tr.reference})" if tr.reference else "")
            for tr in TRANSFORMS)
        return OK, {"supported_versions": list(SUPPORTED), "transforms": doc}, text, ""

    run("list", as_json, body)


@cli.command()
@target_options
def recover(python, site_packages, as_json):
    """Finish or roll back a run that was interrupted."""

    def body():
        t = find_target(python, site_packages)
        done = engine.recover(t)
        text = _recover_line(done) or "nothing to recover"
        return OK, {"target": t.describe(), "recovered": done}, text, ""

    run("recover", as_json, body)


@cli.command()
@target_options
def forget(python, site_packages, as_json):
    """Drop saved state that belongs to another install (vLLM upgraded or reinstalled
    since the patch) or cannot be read; removes only the files ddtree-patch added."""

    def body():
        t = find_target(python, site_packages)
        out = engine.forget(t)
        if not out["forgot"]:
            text = "no saved state for this install: nothing to forget"
        else:
            text = (f"forgot the saved state in {out['state_dir']} ("
                    + "; ".join(out["why"]) + f"); removed {len(out['removed'])} files "
                    "ddtree-patch had added")
        return OK, {"target": t.describe(), **out}, text, ""

    run("forget", as_json, body)


@cli.command()
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
        return (OK if report["ok"] else PENDING), report, format_report(report), \
            report.pop("next", "")

    run("verify", as_json, body)


def _terminated(signum, frame):
    raise Terminated()


def main(argv=None) -> None:
    """Console entry point: click's usage errors become documented failures too; SIGTERM
    ends a run as Ctrl-C does (a write in progress is rolled back first); a closed or
    broken stdout/stderr changes nothing but what is seen."""
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    output.guard_streams()
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = cli.main(args, prog_name="ddtree-patch", standalone_mode=False)
    except click.ClickException as exc:
        name = next((a for a in args if a in cli.commands), None)
        path = f"ddtree-patch {name}" if name else "ddtree-patch"
        hint = f"`{path} --help` lists the " + ("options" if name else "commands")
        if isinstance(exc, click.exceptions.NoArgsIsHelpError):
            if not as_json:
                click.echo(exc.format_message(), err=True)
                output.emit_next(hint)
                sys.exit(USAGE)
            exc.message = "no command given"
        fail(name or "ddtree-patch", as_json, PatchError(exc.format_message(), USAGE, hint))
    except (KeyboardInterrupt, click.exceptions.Abort, Terminated) as exc:
        code, why = interruption(exc) or (INTERRUPTED, "interrupted by SIGINT (Ctrl-C)")
        fail("ddtree-patch", as_json, PatchError(why, code, "`ddtree-patch status` tells "
                                                 "whether a `recover` is needed"))
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
