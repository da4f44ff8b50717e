"""Launch-config sweep of the tree-attention kernel at verify shapes (Qwen3-8B attention:
32 query / 8 KV heads, head_dim 128, bf16, block 16, context 512, real DDTree masks),
per layer, CUDA-graph replay.  Every config's output is checked against the torch
oracle (bf16 tol 8e-3) before it is timed.  Writes OUT/attn_sweep.json (all timings)
and OUT/attn_tuning.json (the table cuda_attention.TUNING reads through
VLLM_DDTREE_ATTN_TUNING), and prints the picks next to the default config.

    python bench/gpu/attn_sweep.py OUT_DIR
    SWEEP_FROM_CHECKOUT=1 python bench/gpu/attn_sweep.py OUT_DIR   (this checkout, no vLLM)
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

# (N, B); B = 63: the V2 default's tree for num_speculative_tokens = 64 (1 + B on a tile)
SHAPES = [(1, 63), (1, 16), (2, 63), (4, 64), (1, 256), (16, 64)]
BUCKETS = [(96, [(1, 63), (1, 16)]), (512, [(2, 63), (4, 64), (1, 256)]), (2048, [(16, 64)])]
# stage 1: tiles and key splits, the context in a loop of its own (two_loops); stage 2,
# around the two best: warps / software-pipeline depth (5+: loads two tiles ahead), a
# register cap (more programs per SM), the one-loop kernel (what two_loops saves) and the
# splits merged by the last one (fused_combine: no second launch) or by an 8-warp
# combine (combine_warps) or one of 16 rows a program (combine_rows: 4x the programs;
# run 25: the fused merge lost, 16-row programs won)
STAGE1 = [dict(block_q=bq, block_n=bn, splits=s, two_loops=True)
          for bq, bn, s in itertools.product((4, 8, 16), (16, 32, 64), (1, 2, 4, 8))]
STAGE2 = [dict(num_warps=w, num_stages=st) for w, st in ((4, 2), (4, 5), (4, 6), (8, 3), (8, 5))] \
    + [dict(maxnreg=128), dict(maxnreg=168), dict(two_loops=False), dict(fused_combine=True),
       dict(combine_warps=8), dict(combine_rows=16), dict(combine_rows=16, combine_warps=2)]


def main():
    global SHAPES, STAGE1, BUCKETS
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    budget_s = float(os.environ.get("SWEEP_BUDGET_S", "200"))
    import triton.testing as tt

    if os.environ.get("SWEEP_FROM_CHECKOUT"):  # this checkout's payload: torch + Triton only
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        import ddtree_patcher.patches.ddtree.payload.attention.triton_tree as ca
        from ddtree_patcher.patches.ddtree.payload.core import build_tree
    else:  # the payload as `ddtree-patch apply` put it into vLLM
        import vllm.v1.spec_decode.ddtree.attention.triton_tree as ca
        from vllm.v1.spec_decode.ddtree.core import build_tree

    from ddtree_patcher.patches.ddtree.reference.tree_attention import reference_tree_attention

    dev = "cuda"
    hq, hkv, d, bs, ctx = 32, 8, 128, 16, 512
    dt = torch.bfloat16
    if os.environ.get("SWEEP_SMOKE"):  # CPU smoke run of this script (TRITON_INTERPRET=1)
        dev, hq, hkv, d, ctx, dt = "cpu", 4, 1, 16, 20, torch.float16
        SHAPES = [(1, 8), (2, 8)]
        BUCKETS = [(16, SHAPES)]
        STAGE1 = STAGE1[:3]
    if os.environ.get("SWEEP_STAGE1") == "table":  # stage 1 = the built-in table's
        # configs: stage 2 (around them) fits a short device call
        STAGE1 = [dict(t) for t in {tuple((k, v) for k, v in sorted(e.items()) if k != "max_rows")
                                    for e in ca.TUNING}]
    if os.environ.get("SWEEP_SHAPES"):  # e.g. "4x64,16x64"
        SHAPES = [tuple(int(v) for v in x.split("x")) for x in os.environ["SWEEP_SHAPES"].split(",")]
    t0 = time.time()
    cases, res = {}, []
    # the floor probe: the same shapes with no committed context (the tree part alone)
    floor = [] if os.environ.get("SWEEP_FLOOR", "1") == "0" else [(n, b, 0) for n, b in SHAPES]
    for n, b, c in [(n, b, ctx) for n, b in SHAPES] + floor:
        g = torch.Generator(device=dev).manual_seed(n * 1000 + b)
        q_len, seq = b + 1, c + b + 1
        nblk = (seq + bs - 1) // bs
        kv = torch.randn(2, n * nblk + 1, bs, hkv, d, device=dev, dtype=dt,
                         generator=g)
        bt = torch.randperm(n * nblk, device=dev, generator=g).to(torch.int32).view(n, nblk)
        q = torch.randn(n * q_len, hq, d, device=dev, dtype=dt, generator=g)
        qsl = torch.arange(0, n + 1, device=dev, dtype=torch.int32) * q_len
        sl = torch.full((n,), seq, device=dev, dtype=torch.int32)
        st = ca.TreeState(n, b, dev)
        tree = build_tree(torch.randn(n, 15, 4096, device=dev, generator=g) * 3, b, b)
        st.mask.copy_(tree.ancestor_mask.view(torch.int8))
        st.has_tree.fill_(1)
        ref = reference_tree_attention(q, kv[0], kv[1], bt, sl, qsl, st.has_tree, st.mask,
                                          d ** -0.5, hkv)
        cases[(n, b) if c else (n, b, 0)] = (q, kv, bt, qsl, sl, st, ref, q_len)

    def bench(n, b, cfg, case=None):
        q, kv, bt, qsl, sl, st, ref, q_len = cases[case or (n, b)]
        out = torch.empty_like(q)

        def fn():
            ca.launch(q, kv[0], kv[1], out, bt, sl, qsl, st.has_tree, st.mask, d ** -0.5,
                      q_len, hkv, **cfg)

        try:
            out.fill_(float("nan"))
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            # bf16 rounding of the output: 8e-3 up to |out| = 1 (no context: rows that
            # see one key return V itself, |V| up to ~4)
            if not err <= 8e-3 * max(1.0, ref.abs().max().item() / 2):
                return None, f"wrong (err {err:.3g})"
            if dev == "cpu":
                t = time.perf_counter()
                fn()
                return (time.perf_counter() - t) * 1e6, None
            return tt.do_bench_cudagraph(fn, rep=20) * 1e3, None
        except Exception as e:  # e.g. out of shared memory
            if os.environ.get("SWEEP_SMOKE"):
                raise
            return None, type(e).__name__

    def run(n, b, cfg, stage):
        us, why = bench(n, b, cfg)
        row = {"N": n, "B": b, "stage": stage, **cfg, "us": us, "error": why}
        res.append(row)
        return us

    default = {}
    for n, b in SHAPES:
        run(n, b, default, "default")
    # the floor (RESULTS "why the tree attention kernel costs 2x FA3"): what a launch
    # costs with no context, one program per query block (splits 1) and with the
    # table's splits, next to an empty kernel replayed the same way
    floors = []
    for n, b, _ in floor:
        for cfg in ({}, {"splits": 1}):
            us, why = bench(n, b, cfg, (n, b, 0))
            floors.append({"N": n, "B": b, "ctx": 0, **cfg, "us": us, "error": why})
    if floor and dev == "cuda":
        x = torch.zeros(1, device=dev)
        floors.append({"empty_kernel_us": tt.do_bench_cudagraph(lambda: x.add_(1), rep=20) * 1e3})
    for row in floors:
        print(json.dumps(row), flush=True)
    for stage, grid in (("1", STAGE1), ("2", None)):
        for n, b in SHAPES:
            if time.time() - t0 > budget_s:
                break
            if grid is None:  # warps/stages around the two best of stage 1
                best = sorted((r for r in res if (r["N"], r["B"]) == (n, b) and r["us"]
                               and r["stage"] == "1"), key=lambda r: r["us"])[:2]
                grid = []
                for r in best:
                    base = {k: r[k] for k in ("block_q", "block_n", "splits", "two_loops")}
                    grid += [dict(base, **x) for x in STAGE2]
                for cfg in grid:
                    run(n, b, cfg, stage)
                grid = None
                continue
            for cfg in grid:
                run(n, b, cfg, stage)
    keys = ("block_q", "block_n", "splits", "two_loops", "num_warps", "num_stages", "maxnreg",
            "fused_combine", "combine_warps", "combine_rows")

    def score(cfg, shapes):  # sum of time / best time per shape (None: unusable)
        tot = 0.0
        for s in shapes:
            rows = [r for r in res if (r["N"], r["B"]) == s and r["us"]]
            mine = [r["us"] for r in rows if all(r.get(k) == cfg.get(k) for k in keys)]
            if not mine:
                return None
            tot += min(mine) / min(r["us"] for r in rows)
        return tot

    tuning, summary = [], []
    for bound, shapes in BUCKETS:
        # a partial sweep (SWEEP_SHAPES) tunes a bucket on the shapes of it that ran
        shapes = [s for s in shapes if any((r["N"], r["B"]) == s for r in res)]
        cands = {tuple(r.get(k) for k in keys) for r in res if r["us"] and r["stage"] != "default"}
        scored = [(score(dict(zip(keys, c)), shapes), c) for c in cands] if shapes else []
        scored = [x for x in scored if x[0] is not None]
        if not scored:
            continue
        _, c = min(scored)
        pick = {k: v for k, v in zip(keys, c) if v is not None}
        tuning.append({"max_rows": bound, **pick})
        for s in shapes:
            dflt = [r["us"] for r in res if (r["N"], r["B"]) == s and r["stage"] == "default"]
            mine = [r["us"] for r in res if (r["N"], r["B"]) == s and r["us"]
                    and all(r.get(k) == pick.get(k) for k in keys)]
            summary.append({"N": s[0], "B": s[1], "default_us": dflt[0] if dflt else None,
                            "tuned_us": min(mine), **pick})
    for row in summary:
        print(json.dumps(row), flush=True)
    print(f"sweep: {len(res)} runs in {time.time() - t0:.0f} s", flush=True)
    with open(os.path.join(out_dir, "attn_sweep.json"), "w") as f:
        json.dump({"runs": res, "summary": summary, "floor": floors}, f, indent=1)
    # buckets not measured here keep the built-in entries
    done = {t["max_rows"] for t in tuning}
    tuning = sorted(tuning + [t for t in ca.TUNING if t["max_rows"] not in done],
                    key=lambda t: t["max_rows"])
    with open(os.path.join(out_dir, "attn_tuning.json"), "w") as f:
        json.dump(tuning, f, indent=1)


if __name__ == "__main__":
    main()
