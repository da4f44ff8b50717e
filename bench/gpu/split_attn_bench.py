"""Tree attention per layer at verify shapes: split (FA prefix + Triton tree part +
fused LSE merge), split with our Triton prefix, the single Triton kernel
(cuda_attention), and FA3 causal over the same query tokens (what a chain verify of
that length costs: the baseline), all in the same run.  Qwen3-8B attention (32 query /
8 KV heads, head_dim 128), bf16, block 16, real DDTree ancestor masks, context 512 and
4096, batch 1/4/16/32, B = 16/64/256; CUDA-graph replay (triton.testing).  Every
variant's output is checked against the single kernel before it is timed.

    python bench/gpu/split_attn_bench.py OUT_DIR [--quick]
    TRITON_INTERPRET=1 python bench/gpu/split_attn_bench.py OUT_DIR --smoke   (CPU plumbing check)

Needs torch + Triton on a CUDA GPU; the payload comes from this checkout (no vLLM
import), FlashAttention from vLLM (``from vllm.vllm_flash_attn import
flash_attn_varlen_func``; without it the FA rows are skipped with a message).  Writes
OUT_DIR/split_attn_bench.json and prints a markdown table.  ~1-2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def payload(name: str):
    """payload/<name>.py imported as vLLM gets it (payload files + core/)."""
    if "ddtree_bench_pkg" not in sys.modules:
        tmp = Path(tempfile.mkdtemp(prefix="ddtree_bench_"))
        shutil.copytree(ROOT / "patches" / "ddtree" / "payload", tmp / "ddtree_bench_pkg")
        sys.path.insert(0, str(tmp))
    return importlib.import_module(f"ddtree_bench_pkg.{name}")


def load_fa():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        return flash_attn_varlen_func, None
    except Exception as e:  # not installed, or built for another torch/CUDA
        return None, f"{type(e).__name__}: {e}"


def make_case(n, b, ctx, hq, hkv, d, bs, dtype, gen, core, dev="cuda"):
    q_len = b + 1
    seq = ctx + q_len
    nblk = (seq + bs - 1) // bs
    kv = torch.randn(2, n * nblk + 1, bs, hkv, d, device=dev, dtype=dtype, generator=gen)
    bt = torch.randperm(n * nblk, device=dev, generator=gen).to(torch.int32).view(n, nblk)
    q = torch.randn(n * q_len, hq, d, device=dev, dtype=dtype, generator=gen)
    qsl = torch.arange(0, n + 1, device=dev, dtype=torch.int32) * q_len
    sl = torch.full((n,), seq, device=dev, dtype=torch.int32)
    ctx_t = torch.full((n,), ctx, device=dev, dtype=torch.int32)
    tree = core.build_tree(torch.randn(n, 15, 4096, device=dev, generator=gen) * 3, b, b,
                           backend="auto" if dev == "cuda" else "torch")
    mask = tree.ancestor_mask.view(torch.int8).contiguous()
    has = torch.ones(n, dtype=torch.int32, device=dev)
    # this step's K/V rows (what the backend's forward gets): positions ctx .. seq - 1
    pos = torch.arange(ctx, seq, device=dev)
    blk = bt[:, pos // bs].long()  # [n, q_len]
    key = kv[0][blk, pos % bs].reshape(n * q_len, hkv, d).contiguous()
    value = kv[1][blk, pos % bs].reshape(n * q_len, hkv, d).contiguous()
    return dict(q=q, kc=kv[0], vc=kv[1], key=key, value=value, bt=bt, qsl=qsl, sl=sl,
                ctx=ctx_t, has=has, mask=mask, q_len=q_len, seq=seq)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true", help="two shapes")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, TRITON_INTERPRET=1")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke needs TRITON_INTERPRET=1")
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("split_attn_bench.py needs a CUDA GPU")
    import triton
    import triton.testing as tt

    def bench(fn):
        if dev == "cpu":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return tt.do_bench_cudagraph(fn, rep=30)

    os.makedirs(args.out_dir, exist_ok=True)
    core = payload("core")
    ca = payload("attention.triton_tree")
    sa = payload("attention.split")
    fa, why = load_fa()
    if fa is None:
        print(f"NOTE: vLLM's flash attention is not importable ({why}); the FA3 baseline "
              "and split-FA rows are skipped. Install vLLM (e.g. 0.32.0) in this env.",
              flush=True)
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    shapes = [(n, b, c) for c in (512, 4096) for n in (1, 4, 16, 32) for b in (16, 64, 256)]
    if args.quick:
        shapes = [(1, 64, 512), (16, 64, 4096)]
    if args.smoke:
        hq, hkv, d, dtype, shapes = 4, 2, 16, torch.float16, [(1, 8, 20), (2, 4, 40)]
        fa = None
    scale = d ** -0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
                torch=torch.__version__,
                triton=triton.__version__, fa=fa is not None, fa_note=why,
                command="python bench/gpu/split_attn_bench.py OUT_DIR" + (" --quick" if args.quick else ""),
                heads=(hq, hkv, d), dtype=str(dtype), block_size=bs)
    print(json.dumps(meta), flush=True)
    rows = []
    t0 = time.time()
    for n, b, ctx in shapes:
        c = make_case(n, b, ctx, hq, hkv, d, bs, dtype, gen, core, dev)
        out = torch.empty_like(c["q"])
        fns = {}
        fns["single"] = lambda: ca.launch(c["q"], c["kc"], c["vc"], out, c["bt"], c["sl"], c["qsl"],
                                          c["has"], c["mask"], scale, c["q_len"], hkv)
        split_kw = dict(ctx_lens=c["ctx"])  # per step, not per layer, in the engine

        def split(prefix):
            return lambda: sa.split_tree_attention(
                c["q"], c["key"], c["value"], c["kc"], c["vc"], out, c["bt"], c["sl"], c["qsl"],
                c["has"], c["mask"], scale, c["q_len"], c["seq"], hkv, prefix=prefix, **split_kw)

        fns["split_triton"] = split("triton")
        if fa is not None:
            fns["split_fa"] = split("fa")
            fns["fa3_causal"] = lambda: fa(q=c["q"], k=c["kc"], v=c["vc"], out=out,
                                           cu_seqlens_q=c["qsl"], max_seqlen_q=c["q_len"],
                                           seqused_k=c["sl"], max_seqlen_k=c["seq"],
                                           softmax_scale=scale, causal=True, block_table=c["bt"],
                                           fa_version=3)
            fns["fa3_prefix_only"] = lambda: fa(q=c["q"], k=c["kc"], v=c["vc"], out=out,
                                                cu_seqlens_q=c["qsl"], max_seqlen_q=c["q_len"],
                                                seqused_k=c["ctx"], max_seqlen_k=c["seq"],
                                                softmax_scale=scale, causal=False,
                                                block_table=c["bt"], return_softmax_lse=True,
                                                fa_version=3)
            lse = torch.zeros(hq, c["q"].shape[0], device=dev)
            fns["tree_part_only"] = lambda: sa.tree_part(c["q"], c["key"], c["value"], out,
                                                         c["qsl"], c["has"], c["mask"], scale,
                                                         c["q_len"], hkv, (0, lse, out))
        row = {"N": n, "B": b, "ctx": ctx}
        ref = None
        for name in ("single", "split_fa", "split_triton"):  # correctness first
            if name not in fns:
                continue
            out.fill_(float("nan"))
            fns[name]()
            if dev == "cuda":
                torch.cuda.synchronize()
            if ref is None:
                ref = out.float().clone()
            else:
                row[f"{name}_maxerr_vs_single"] = (out.float() - ref).abs().max().item()
        for name, fn in fns.items():
            try:
                row[f"{name}_us"] = bench(fn) * 1e3
            except Exception as e:  # keep going: one failing variant must not sink the run
                row[f"{name}_us"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        base = row.get("fa3_causal_us")
        for name in ("single", "split_fa", "split_triton"):
            if base and row.get(f"{name}_us"):
                row[f"{name}_vs_fa3"] = row[f"{name}_us"] / base
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
        if dev == "cuda":  # (the next case rebinds c / out / fns: this one is freed then)
            torch.cuda.empty_cache()
    meta["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out_dir, "split_attn_bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    cols = ["fa3_causal", "single", "split_fa", "split_triton", "fa3_prefix_only", "tree_part_only"]
    print("\n| N | B | ctx | " + " | ".join(f"{c} us" for c in cols)
          + " | single / FA3 | split_fa / FA3 | split_fa err |")
    print("| ---: " * (3 + len(cols) + 3) + "|")
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in rows:
        print(f"| {r['N']} | {r['B']} | {r['ctx']} | "
              + " | ".join(fmt(r.get(f"{c}_us")) for c in cols)
              + f" | {fmt(r.get('single_vs_fa3'), 2)} | {fmt(r.get('split_fa_vs_fa3'), 2)}"
              + f" | {fmt(r.get('split_fa_maxerr_vs_single'), 4)} |")
    print(f"done in {meta['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
