"""bench/gpu/attn_sweep.py end to end on the CPU (its SWEEP_SMOKE mode, the Triton
interpreter): the payload laid out as the installed vLLM package it imports from, a
whole sweep and a partial one (SWEEP_SHAPES), each writing its timings and a tuning
table."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# not imported here: triton read at collection, before tests/core and tests/gpu set
# TRITON_INTERPRET, would leave their kernels compiled for a GPU this machine lacks
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton (its CPU interpreter)")
ROOT = Path(__file__).resolve().parents[2]


def tuning_table() -> list[dict]:
    """The built-in TUNING, read from the source (importing it would load triton)."""
    import ast

    src = (ROOT / "patches/ddtree/payload/attention/triton_tree.py").read_text()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.AnnAssign)
                and getattr(n.target, "id", None) == "TUNING")
    return ast.literal_eval(node.value)


def layout(tmp: Path) -> Path:
    """tmp/site: vllm/v1/spec_decode/ddtree -> the payload; ddtree_patcher with its
    patches (the reference the sweep checks against)."""
    site = tmp / "site"
    sd = site / "vllm" / "v1" / "spec_decode"
    sd.mkdir(parents=True)
    for d in (site / "vllm", site / "vllm" / "v1", sd):
        (d / "__init__.py").write_text("")
    (sd / "ddtree").symlink_to(ROOT / "patches" / "ddtree" / "payload")
    pkg = site / "ddtree_patcher"
    pkg.mkdir()
    for f in (ROOT / "ddtree_patcher").iterdir():
        (pkg / f.name).symlink_to(f)
    (pkg / "patches").symlink_to(ROOT / "patches")
    return site


@pytest.mark.parametrize("shapes,checkout,stage1", [(None, False, None), ("1x8", False, None),
                                                     ("1x8", True, None), ("1x8", True, "table")])
def test_the_sweep_runs_and_tunes_what_it_measured(tmp_path, shapes, checkout, stage1):
    """checkout: SWEEP_FROM_CHECKOUT (no vLLM layout on the path: this checkout's payload);
    stage1 'table': stage 1 is the built-in table's configs (a short device call)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "SWEEP_SMOKE": "1"}
    env.pop("SWEEP_STAGE1", None)
    if stage1:
        env["SWEEP_STAGE1"] = stage1
    if checkout:
        env["SWEEP_FROM_CHECKOUT"] = "1"
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = str(layout(tmp_path))
    env.pop("VLLM_DDTREE_ATTN_TUNING", None)
    if shapes:
        env["SWEEP_SHAPES"] = shapes
    out = tmp_path / "out"  # made by the sweep
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "attn_sweep.py"),
                        str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = json.loads((out / "attn_sweep.json").read_text())
    measured = {(r["N"], r["B"]) for r in runs["runs"]}
    assert measured == ({(1, 8)} if shapes else {(1, 8), (2, 8)})
    assert all(r["error"] is None and r["us"] > 0 for r in runs["runs"])
    if stage1 == "table":  # stage 1 ran the built-in table's distinct configs, no others
        table_cfgs = {(e["block_q"], e["block_n"], e["splits"]) for e in tuning_table()}
        assert {(r["block_q"], r["block_n"], r["splits"]) for r in runs["runs"]
                if r["stage"] == "1"} == table_cfgs
        assert any(r["stage"] == "2" and r.get("fused_combine") for r in runs["runs"])
    # the smoke bucket (16 rows) is tuned on the shapes that ran, the rest kept
    table = json.loads((out / "attn_tuning.json").read_text())
    assert [t["max_rows"] for t in table][0] == 16
    assert {(s["N"], s["B"]) for s in runs["summary"]} == measured
    # the floor probe: no context, the table's splits and splits 1, each checked first
    assert {(r["N"], r["B"], r.get("splits")) for r in runs["floor"]} == \
        {(n, b, s) for n, b in measured for s in (None, 1)}
    assert all(r["ctx"] == 0 and r["error"] is None and r["us"] > 0 for r in runs["floor"])
