"""The tree-attention kernel against FA3 at verify shapes (Qwen3-8B attention: 32 query /
8 KV heads, head_dim 128, bf16, block 16, context 512), per layer, CUDA-graph replay
(triton.testing.do_bench_cudagraph).  FA3 runs causal over the same query (what a chain
verify costs); the tree kernel applies a real DDTree ancestor mask.

    python bench/gpu/kernel_bench.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    out_dir = sys.argv[1]
    import triton.testing as tt

    import vllm.v1.spec_decode.ddtree.attention.triton_tree as ca
    from vllm.v1.spec_decode.ddtree.core import build_tree
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = "cuda"
    hq, hkv, d, bs, ctx = 32, 8, 128, 16, 512
    res = []
    for n in (1, 4, 16, 32):
        for b in (15, 16, 64, 256):
            q_len = b + 1
            seq = ctx + q_len
            nblk = (seq + bs - 1) // bs
            kv = torch.randn(2, n * nblk + 1, bs, hkv, d, device=dev, dtype=torch.bfloat16)
            bt = torch.arange(n * nblk, device=dev, dtype=torch.int32).view(n, nblk)
            q = torch.randn(n * q_len, hq, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            qsl = torch.arange(0, n + 1, device=dev, dtype=torch.int32) * q_len
            sl = torch.full((n,), seq, device=dev, dtype=torch.int32)
            st = ca.TreeState(n, b, dev)
            lg = torch.randn(n, 15, 151936, device=dev) * 3
            tree = build_tree(lg, b, b)
            st.mask.copy_(tree.ancestor_mask.view(torch.int8))
            st.has_tree.fill_(1)

            def tree_fn():
                ca.launch(q, kv[0], kv[1], out, bt, sl, qsl, st.has_tree, st.mask,
                          d ** -0.5, q_len, hkv)

            def fa_fn():
                flash_attn_varlen_func(q=q, k=kv[0], v=kv[1], out=out, cu_seqlens_q=qsl,
                                       max_seqlen_q=q_len, seqused_k=sl, max_seqlen_k=seq,
                                       softmax_scale=d ** -0.5, causal=True,
                                       block_table=bt, fa_version=3)

            tree_fn()
            fa_fn()
            torch.cuda.synchronize()
            t_tree = tt.do_bench_cudagraph(tree_fn, rep=50)
            t_fa = tt.do_bench_cudagraph(fa_fn, rep=50)
            row = {"N": n, "B": b, "tree_us": t_tree * 1e3, "fa3_causal_us": t_fa * 1e3,
                   "x36_layers_extra_ms": (t_tree - t_fa) * 36}
            res.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "kernel_bench.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
