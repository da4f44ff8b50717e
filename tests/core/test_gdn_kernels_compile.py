"""The tree GDN Triton kernels compile for NVIDIA targets (sm_80, sm_90) on this machine,
no GPU needed: the interpreter tests prove what they compute, this proves the compiled
form exists (a loop-carried type or a layout Triton cannot lower fails here, not on the
first device call).  bench/kernel_resources.py does the compiling and reports registers
and spills (reported, never asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> Path | None:
    try:
        import triton
    except Exception:  # noqa: BLE001
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return p if p.exists() else None


@pytest.mark.skipif(_ptxas() is None, reason="needs Triton with its bundled ptxas")
@pytest.mark.parametrize("arch", [80, 90])
def test_gdn_kernels_compile(arch):
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py"),
                          "--arch", str(arch), "--json"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"verify", "conv", "commit", "conv_commit", "tree_attn", "combine",
                       "select", "topk_groups", "topk_gather", "topk_final", "argmax_part",
                       "argmax_final"}
    assert {r["rows"] for r in rows if r["kernel"] == "verify"} == {17, 65, 257}
    # the split buckets' merge launch, whole blocks and 16 rows a program, no spill
    # (compiled with the JIT's alignment marks, as launched)
    merges = [r for r in rows if r["kernel"] == "combine"]
    assert merges and {r["chunk"] for r in merges} >= {16}
    assert all(r["spill_stores"] in (0, None) for r in merges), merges
    for r in rows:  # ptxas ran on every kernel and said what it used
        assert isinstance(r["registers"], int) and r["registers"] > 0, r


@pytest.mark.skipif(_ptxas() is None, reason="needs Triton with its bundled ptxas")
def test_the_attention_launch_model():
    """--attn-grid: every config of the grid compiled for sm_90, with its programs and
    waves as the launch makes them (1 request of 65 rows: 9 query blocks of 8 tokens)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py"),
                          "--arch", "90", "--attn-grid", "1x64", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    grid = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(grid) == 54
    for r in grid:
        assert r["registers"] > 0 and r["per_sm"] >= 1
    one = next(r for r in grid if (r["block_q"], r["block_n"], r["splits"]) == (8, 32, 8))
    assert one["programs"] == 9 * 8 * 8 and one["tiles"] == 3  # ceil(577 / 256)
    assert one["waves"] == -(-one["programs"] // (one["per_sm"] * 132))
