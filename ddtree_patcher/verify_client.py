"""Start the verify suite (verify/runner.py) in a fresh interpreter of the target env.

Each check ends ``passed``, ``failed`` or ``skipped`` (with the reason); a skipped check
is never counted as passed, and the summary names what was not checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .state import state_for
from .target import Target

CHECKS = ("integrity", "imports", "kernels", "engine")


def _oracle() -> Path:
    """patches/ddtree/reference/heap.py, found without importing the transforms."""
    spec = importlib.util.find_spec("ddtree_patcher.patches")
    return Path(next(iter(spec.submodule_search_locations))) / "ddtree" / "reference" / "heap.py"


def _plan_checks(t: Target, quick: bool) -> tuple[list[str], dict[str, str]]:
    """Checks to run, and the reason each other one is skipped."""
    skipped = {}
    if not t.python:
        for name in CHECKS[1:]:
            skipped[name] = "a bare --site-packages tree has no interpreter: use --python"
    elif quick:
        skipped["engine"] = "--quick; `ddtree-patch verify` runs it"
    return [c for c in CHECKS if c not in skipped], skipped


def _spec(t: Target, checks: list[str], quick: bool, seed: int | None) -> dict:
    manifest = state_for(t.key, t.real, t.reinstall_hint()).load_manifest()
    return {
        "site": str(t.site), "dist_info": str(t.dist_info), "dist": t.dist,
        "version": t.version, "checks": checks, "quick": quick, "seed": seed,
        "files": {rel: rec.post_sha for rel, rec in manifest.files.items()} if manifest
        else {},
        "applied": manifest.applied if manifest else [],
        "missing": manifest.missing if manifest else [],
    }


def run_verify(t: Target, quick: bool = False, seed: int | None = None) -> dict:
    """Copy verify/ (and the heapq oracle, which is not installed into vLLM) to a temp
    folder as package ``ddtree_verify`` and run its runner in a fresh interpreter of
    the target environment (never in this process)."""
    from . import verify as pkg

    checks, skipped = _plan_checks(t, quick)
    spec = _spec(t, checks, quick, seed)
    python = t.python or sys.executable
    with tempfile.TemporaryDirectory(prefix="ddtree-verify-") as tmp:
        dest = Path(tmp) / "ddtree_verify"
        shutil.copytree(Path(pkg.__file__).parent, dest,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(_oracle(), dest / "heap_reference.py")
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [tmp, os.environ.get(
                       "PYTHONPATH")])))
        proc = subprocess.run([python, "-m", "ddtree_verify.runner", str(spec_path)],
                              capture_output=True, text=True, env=env, cwd=tmp,
                              timeout=3600)
    results = None
    for line in proc.stdout.splitlines():
        if line.startswith("DDTREE-VERIFY "):
            results = json.loads(line[len("DDTREE-VERIFY "):])
    if results is None:
        results = [{"check": "runner", "status": "failed", "seconds": 0.0,
                    "message": f"the verify runner died (exit {proc.returncode}): "
                               + proc.stderr.strip()[-800:]}]
    results += [{"check": name, "status": "skipped", "seconds": 0.0,
                 "message": f"skipped: {why}"} for name, why in skipped.items()]
    return report(t, results)


def report(t: Target, results: list[dict]) -> dict:
    for r in results:
        r["ok"] = r["status"] == "passed"  # a skipped check is not a passed one
        r["skipped"] = r["status"] == "skipped"
    failed = [r for r in results if r["status"] == "failed"]
    skipped = [r for r in results if r["status"] == "skipped"]
    passed = [r["check"] for r in results if r["status"] == "passed"]
    if failed:
        summary = "verify FAILED: " + ", ".join(r["check"] for r in failed)
    elif skipped:
        why: dict[str, list[str]] = {}
        for r in skipped:
            why.setdefault(r["message"].removeprefix("skipped: "), []).append(r["check"])
        summary = (f"verify: passed {', '.join(passed) or 'nothing'}; NOT checked: "
                   + "; ".join(f"{', '.join(names)} ({reason})" for reason, names in
                               why.items()))
    else:
        summary = f"verify: all checks passed ({', '.join(passed)})"
    doc = {"ok": not failed, "complete": not failed and not skipped, "checks": results,
           "failed": failed, "skipped": [r["check"] for r in skipped], "summary": summary,
           "recovery": recovery_commands(t)}
    if failed:
        doc["next"] = "; or ".join(f"`{c}`" for c in doc["recovery"])
    return doc


def recovery_commands(t: Target) -> list[str]:
    where = f" --python {t.python}" if t.python else f" --site-packages {t.site}"
    pip = f"{t.python or 'python'} -m pip install --force-reinstall --no-deps " \
          f"{t.dist}=={t.version}"
    if not t.python:
        pip += f" --target {t.site}"
    return [f"ddtree-patch revert{where}", pip]


def format_report(report: dict) -> str:
    from .output import table

    rows = [[r["check"], {"passed": "ok", "failed": "FAIL", "skipped": "skip"}[r["status"]],
             f"{r['seconds']:.1f}s", r["message"]] for r in report["checks"]]
    text = table(rows, ["check", "result", "time", "detail"]) + "\n" + report["summary"]
    if report["failed"]:
        text += "\nto recover:\n" + "\n".join("  " + c for c in report["recovery"])
    return text
