"""Start the verify suite (verify/runner.py) in a fresh interpreter of the target env."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .state import State
from .target import Target


def _spec(t: Target, quick: bool, seed: int | None) -> dict:
    manifest = State(t.key).load_manifest() or {"files": {}, "applied": []}
    checks = ["integrity"]
    if t.python:
        checks += ["imports", "kernels"] + ([] if quick else ["engine"])
    return {
        "site": str(t.site), "dist_info": str(t.dist_info), "dist": t.dist,
        "version": t.version, "checks": checks, "quick": quick, "seed": seed,
        "files": {rel: rec["post_sha"] for rel, rec in manifest["files"].items()},
        "applied": manifest["applied"],
    }


def run_verify(t: Target, quick: bool = False, seed: int | None = None) -> dict:
    """Copy verify/ to a temp folder as package ``ddtree_verify`` and run its runner in
    a fresh interpreter of the target environment (never in this process)."""
    from . import verify as pkg

    spec = _spec(t, quick, seed)
    python = t.python or sys.executable
    with tempfile.TemporaryDirectory(prefix="ddtree-verify-") as tmp:
        shutil.copytree(Path(pkg.__file__).parent, Path(tmp) / "ddtree_verify",
                        ignore=shutil.ignore_patterns("__pycache__"))
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
        results = [{"check": "runner", "ok": False, "seconds": 0.0,
                    "message": f"the verify runner died (exit {proc.returncode}): "
                               + proc.stderr.strip()[-800:]}]
    if not t.python:
        results.append({"check": "imports, kernels, engine", "ok": True, "seconds": 0.0,
                        "skipped": True, "message": "skipped: a bare --site-packages tree "
                        "has no interpreter (use --python)"})
    failed = [r for r in results if not r["ok"]]
    ok = not failed
    summary = ("verify: all checks passed" if ok else
               "verify FAILED: " + ", ".join(r["check"] for r in failed))
    return {"ok": ok, "checks": results, "failed": failed, "summary": summary,
            "recovery": recovery_commands(t)}


def recovery_commands(t: Target) -> list[str]:
    where = f" --python {t.python}" if t.python else f" --site-packages {t.site}"
    pip = f"{t.python or 'python'} -m pip install --force-reinstall --no-deps " \
          f"{t.dist}=={t.version}"
    if not t.python:
        pip += f" --target {t.site}"
    return [f"ddtree-patch revert{where}", pip]


def format_report(report: dict, t: Target) -> str:
    from .output import table

    rows = [[r["check"], "skip" if r.get("skipped") else ("ok" if r["ok"] else "FAIL"),
             f"{r['seconds']:.1f}s", r["message"]] for r in report["checks"]]
    text = table(rows, ["check", "result", "time", "detail"]) + "\n" + report["summary"]
    if not report["ok"]:
        text += "\nto recover:\n" + "\n".join("  " + c for c in report["recovery"])
    return text
