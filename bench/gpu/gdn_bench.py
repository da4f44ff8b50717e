#!/usr/bin/env python3
"""Cost of one GDN layer's speculative step on the GPU: the tree path (core/gdn_tree.py)
vs vLLM's chain path, at Qwen3.6-27B head sizes (16 key heads, 48 value heads,
K = V = 128, conv width 4, bf16 activations, fp32 state).

    python bench/gpu/gdn_bench.py [--budgets 16,64,256] [--batches 1,8] [--out FILE]

Per (B, batch N), median of --reps CUDA-graph replays (eager too with --eager):
  tree verify   tree conv + gates + tree-masked delta rule (outputs of B+1 rows);
                also with the state as the engine passes it (bf16 [HV, V, K] cache rows
                gathered by slot, transposed): tree_verify_engine_state_us
  tree commit   state + conv history along a depth-L accepted path
  tree / step   ancestor mask + conv windows (once per step, shared by all layers)
  engine layer  what the engine runs per layer (gdn/cuda.py GDNTree.forward on vLLM's
                cache layout: conv + verify launches reading the caches by slot),
                engine_plan_us its once-per-step plan, engine_commit_us its commit
  chain k=15    vLLM's causal_conv1d_update + fused_sigmoid_gating_delta_rule_update
                over 16 tokens per request (DFlash chain, state slot per token)
  chain k=B     the same over B+1 tokens (same tokens as the tree)
The chain rows need vLLM (0.20.x: vllm.model_executor.layers.fla, 0.32+:
vllm.third_party.flash_linear_attention); without it they are reported missing.
Prints a table and writes JSON (--out).  No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddtree_patcher.patches.ddtree.payload.core import build_tree  # noqa: E402
from ddtree_patcher.patches.ddtree.payload.core.gdn_tree import (  # noqa: E402
    conv_commit, conv_windows, gdn_gates, tree_conv1d, tree_gdn_commit, tree_gdn_verify,
    tree_mask)
from ddtree_patcher.patches.ddtree.payload.core.gdn_triton import VERIFY_BLOCKS  # noqa: E402
from ddtree_patcher.patches.ddtree.payload.gdn import cuda as gdn_cuda  # noqa: E402

H, HV, K, V, W = 16, 48, 128, 128, 4
C = 2 * H * K + HV * V
DEPTH = 15


def _vllm_chain():
    """vLLM's chain kernels, or None."""
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    except Exception:
        return None
    for mod in ("vllm.third_party.flash_linear_attention.ops",
                "vllm.model_executor.layers.fla.ops"):
        try:
            m = __import__(mod, fromlist=["fused_sigmoid_gating_delta_rule_update"])
            return causal_conv1d_update, m.fused_sigmoid_gating_delta_rule_update
        except Exception:
            continue
    return None


def timed(fn, reps: int, graph: bool) -> float:
    """Median microseconds of fn() (replayed from a CUDA graph when graph=True)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def tree_case(n: int, b: int, gen):
    dev = "cuda"
    tree = build_tree(torch.randn(n, DEPTH, 256, generator=gen).to(dev) * 3, b, b)
    t = b + 1
    x = torch.randn(n, t, C, generator=gen).to(dev, torch.bfloat16)
    hist = torch.randn(n, C, W - 1, generator=gen).to(dev, torch.bfloat16)
    weight = torch.randn(C, W, generator=gen).to(dev, torch.bfloat16) * 0.5
    a = torch.randn(n, t, HV, generator=gen).to(dev, torch.bfloat16)
    bb = torch.randn(n, t, HV, generator=gen).to(dev, torch.bfloat16)
    A_log = torch.randn(HV, generator=gen).to(dev) * 0.5
    dt_bias = torch.randn(HV, generator=gen).to(dev)
    h0 = torch.randn(n, HV, K, V, generator=gen).to(dev) * 0.1
    rows = torch.full((n, DEPTH + 1), -1, dtype=torch.int64, device=dev)
    num = torch.zeros(n, dtype=torch.int64, device=dev)
    for i in range(n):  # accept the deepest node's path
        node = int(tree.depths[i].argmax())
        path = []
        while node >= 0:
            path.append(node + 1)
            node = int(tree.parents[i, node])
        path = [0] + path[::-1]
        rows[i, : len(path)] = torch.tensor(path, device=dev)
        num[i] = len(path) - 1
    return dict(parents=tree.parents, x=x, hist=hist, weight=weight, a=a, b=bb,
                A_log=A_log, dt_bias=dt_bias, h0=h0, rows=rows, num=num)


def bench_tree(c: dict, reps: int, graph: bool) -> dict:
    parents = c["parents"]
    plan = {}

    def per_step():
        plan["mask"] = tree_mask(parents)
        plan["win"] = conv_windows(parents, W)

    per_step()
    out = {}

    def verify():
        y = tree_conv1d(c["x"], c["hist"], c["weight"], None, plan["win"])
        n, t = y.shape[:2]
        q = y[..., : H * K].view(n, t, H, K)
        k = y[..., H * K: 2 * H * K].view(n, t, H, K)
        v = y[..., 2 * H * K:].view(n, t, HV, V)
        g, beta = gdn_gates(c["a"], c["b"], c["A_log"], c["dt_bias"])
        out["o"], out["stash"] = tree_gdn_verify(q, k, v, g, beta, c["h0"], plan["mask"],
                                                 scale=K ** -0.5)

    state = torch.empty_like(c["h0"])

    def commit():
        tree_gdn_commit(c["h0"], out["stash"], c["rows"], c["num"], out=state)
        conv_commit(c["x"], c["hist"], plan["win"], c["rows"], c["num"])

    # the state as the engine hands it over: vLLM's bf16 cache [slots, HV, V, K],
    # gathered by slot and viewed [N, HV, K, V] (gdn/cuda.py: ssm_state[slots].transpose)
    cache = c["h0"].transpose(-1, -2).to(torch.bfloat16).contiguous()
    slots = torch.arange(cache.shape[0], device=cache.device)

    def verify_engine_state():
        y = tree_conv1d(c["x"], c["hist"], c["weight"], None, plan["win"])
        n, t = y.shape[:2]
        g, beta = gdn_gates(c["a"], c["b"], c["A_log"], c["dt_bias"])
        tree_gdn_verify(y[..., : H * K].view(n, t, H, K),
                        y[..., H * K: 2 * H * K].view(n, t, H, K),
                        y[..., 2 * H * K:].view(n, t, HV, V), g, beta,
                        cache[slots].transpose(-1, -2), plan["mask"], scale=K ** -0.5)

    verify()
    return {**bench_engine(c, reps, graph), "tree_step_us": timed(per_step, reps, graph),
            "tree_verify_us": timed(verify, reps, graph),
            "tree_verify_engine_state_us": timed(verify_engine_state, reps, graph),
            "tree_commit_us": timed(commit, reps, graph)}


def bench_engine(c: dict, reps: int, graph: bool) -> dict:
    """One layer's step as gdn/cuda.py runs it in the engine: bf16 x [tokens, C], vLLM's
    caches (conv [slots, C, W-1] bf16, ssm [slots, HV, V, K] bf16) read by slot."""
    from types import SimpleNamespace

    parents = c["parents"]
    n, b = parents.shape
    t, dev = b + 1, parents.device
    conv = torch.nn.Conv1d(C, C, W, groups=C, bias=False).to(dev, torch.bfloat16)
    with torch.no_grad():
        conv.weight.copy_(c["weight"].view(C, 1, W))
    slots_n = n + 1
    layer = SimpleNamespace(
        prefix="layers.0.linear_attn", tp_size=1, num_k_heads=H, num_v_heads=HV,
        head_k_dim=K, head_v_dim=V, key_dim=H * K, value_dim=HV * V, activation="silu",
        conv1d=conv, A_log=c["A_log"], dt_bias=c["dt_bias"])
    conv_state = torch.zeros(slots_n, C, W - 1, dtype=torch.bfloat16, device=dev)
    conv_state[1:] = c["hist"]
    ssm = torch.zeros(slots_n, HV, V, K, dtype=torch.bfloat16, device=dev)
    ssm[1:] = c["h0"].transpose(-1, -2)
    ts = SimpleNamespace(rows=t, has_tree=torch.ones(n, dtype=torch.int32, device=dev),
                         mask=tree_mask(parents).to(torch.int8))
    gdn = gdn_cuda.GDNTree({layer.prefix: layer}, ts, n * t, n, DEPTH, dev)
    qsl = torch.arange(0, n * t + 1, t, dtype=torch.int32, device=dev)
    slots = torch.arange(1, n + 1, device=dev).view(n, 1)
    x = c["x"].reshape(n * t, C)
    a, bb = c["a"].reshape(n * t, HV), c["b"].reshape(n * t, HV)

    def md():
        return SimpleNamespace(num_spec_decodes=n, uniform_spec_sequence_length=t,
                               num_spec_decode_tokens=n * t, num_prefills=0, num_decodes=0,
                               spec_query_start_loc=qsl, spec_state_indices_tensor=slots,
                               spec_sequence_masks_cpu=None)

    def plan():
        gdn.plan(md(), n * t, dev)

    fixed = md()
    gdn.plan(fixed, n * t, dev)

    def layer_step():
        gdn.forward(layer, fixed, x, bb, a, conv_state, ssm)

    def commit():
        gdn._commit_layer(layer.prefix, conv_state, ssm, c["rows"], c["num"], n)

    layer_step()
    return {"engine_plan_us": timed(plan, reps, graph),
            "engine_layer_us": timed(layer_step, reps, graph),
            "engine_commit_us": timed(commit, reps, graph)}


def bench_chain(kernels, n: int, tokens: int, reps: int, graph: bool, gen) -> float:
    conv_update, gdn_update = kernels
    dev = "cuda"
    total = n * tokens
    slots = n * tokens + 1
    x = torch.randn(total, C, generator=gen).to(dev, torch.bfloat16)
    conv_state = torch.randn(n + 1, C, W - 1 + tokens - 1, generator=gen).to(
        dev, torch.bfloat16)  # (slots, dim, state_len), slot 0 = null block
    conv_idx = torch.arange(1, n + 1, dtype=torch.int32, device=dev)
    weight = torch.randn(C, W, generator=gen).to(dev, torch.bfloat16) * 0.5
    ssm = torch.randn(slots, HV, V, K, generator=gen).to(dev) * 0.1
    idx = torch.arange(1, slots, dtype=torch.int32, device=dev).view(n, tokens)
    acc = torch.ones(n, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, total + 1, tokens, dtype=torch.int32, device=dev)
    a = torch.randn(total, HV, generator=gen).to(dev, torch.bfloat16)
    b = torch.randn(total, HV, generator=gen).to(dev, torch.bfloat16)
    A_log = torch.randn(HV, generator=gen).to(dev) * 0.5
    dt_bias = torch.randn(HV, generator=gen).to(dev)

    def step():
        y = conv_update(x, conv_state, weight, None, "silu",
                        conv_state_indices=conv_idx, num_accepted_tokens=acc,
                        query_start_loc=qsl, max_query_len=tokens, validate_data=False)
        q = y[:, : H * K].reshape(1, total, H, K)
        k = y[:, H * K: 2 * H * K].reshape(1, total, H, K)
        v = y[:, 2 * H * K:].reshape(1, total, HV, V)
        gdn_update(A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v,
                   initial_state=ssm, inplace_final_state=True, cu_seqlens=qsl,
                   ssm_state_indices=idx, num_accepted_tokens=acc,
                   use_qk_l2norm_in_kernel=True)

    return timed(step, reps, graph)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--eager", action="store_true", help="also time without CUDA graphs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--blocks", default="",
                    help="also time the engine layer per verify launch, e.g. 32x32x4,64x32x8 "
                         "(rows per chunk x V block x warps; core/gdn_triton.py "
                         "VERIFY_BLOCKS)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gdn_bench: needs CUDA")
        return 2
    kernels = _vllm_chain()
    gen = torch.Generator().manual_seed(0)
    rows = []
    modes = [True] + ([False] if args.eager else [])
    for graph in modes:
        for n in map(int, args.batches.split(",")):
            for b in map(int, args.budgets.split(",")):
                r = {"B": b, "N": n, "graph": graph}
                case = tree_case(n, b, gen)
                r.update(bench_tree(case, args.reps, graph))
                for blk in filter(None, args.blocks.split(",")):
                    bc, bv, warps = map(int, blk.split("x"))
                    old = dict(VERIFY_BLOCKS)
                    VERIFY_BLOCKS.update(bc=bc, bv=bv, warps=warps)
                    try:
                        t = bench_engine(case, args.reps, graph)
                        r[f"engine_layer_{blk}_us"] = t["engine_layer_us"]
                    finally:
                        VERIFY_BLOCKS.clear()
                        VERIFY_BLOCKS.update(old)
                if kernels is not None:
                    r["chain_k15_us"] = bench_chain(kernels, n, 16, args.reps, graph, gen)
                    r["chain_kB_us"] = bench_chain(kernels, n, b + 1, args.reps, graph, gen)
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\nper GDN layer, microseconds (median of {args.reps}); chain kernels: "
          f"{'vLLM' if kernels else 'missing (vLLM not importable)'}")
    print(f"{'graph':>5} {'N':>3} {'B':>4} {'layer':>7} {'commit':>7} {'plan':>6} "
          f"{'api-verify':>10} {'chain15':>8} {'chainB':>8} {'tree/chain15':>12}")
    for r in rows:  # tree = what one layer adds per step in the engine
        tree = r["engine_layer_us"] + r["engine_commit_us"]
        c15, cb = r.get("chain_k15_us"), r.get("chain_kB_us")
        print(f"{str(r['graph']):>5} {r['N']:>3} {r['B']:>4} {r['engine_layer_us']:7.1f} "
              f"{r['engine_commit_us']:7.1f} {r['engine_plan_us']:6.1f} "
              f"{r['tree_verify_us']:10.1f} "
              f"{c15 if c15 is not None else float('nan'):8.1f} "
              f"{cb if cb is not None else float('nan'):8.1f} "
              f"{tree / c15 if c15 else float('nan'):12.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "heads": [H, HV, K, V, W]},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
