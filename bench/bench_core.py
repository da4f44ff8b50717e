"""DDTree core benchmarks: tree build, tree walk, KV compaction, and their share of a
Qwen3-8B-shaped verify forward.  Prints tables; no asserts.

    python bench/bench_core.py            # full sizes (needs a CUDA GPU)
    python bench/bench_core.py --quick    # tiny sizes, runs on the CPU too
    python bench/bench_core.py --out DIR  # also write DIR/core_bench.json and .md
    python bench/bench_core.py --only build --out DIR   # issue 13's build rows (~1-2 min, H200)

Timing: medians of per-call CUDA events (eager: includes launch overhead, since the
GPU waits on the host), CUDA-graph replays, or wall clock for the host-syncing
heap baseline.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_patcher.patches.ddtree.payload.core import (  # noqa: E402
    build_chain_from_topk,
    build_tree,
    build_tree_from_topk,
    compact_kv,
    row_logsumexp,
    vocab_topk,
    walk_greedy,
    walk_sampled,
)
from ddtree_patcher.patches.ddtree.payload.core._triton import HAS_TRITON  # noqa: E402
from ddtree_patcher.patches.ddtree.reference.heap import build_tree_ports_style  # noqa: E402
from ddtree_patcher.patches.ddtree.payload.core.budget import H200_VLLM_0_20_2, BudgetController, CostTable, build_controlled  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
ROWS = []  # (section, config, variant, ms, note)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def t_events(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    sync()
    if not CUDA:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    sync()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def t_graph(fn, reps=50):
    if not CUDA:
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    sync()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    sync()
    del g
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def t_wall(fn, reps=3):
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def record(section, cfg, variant, fn):
    try:
        ms = fn()
        note = ""
    except Exception as e:  # keep going: one broken variant must not sink the run
        ms, note = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ROWS.append((section, cfg, variant, ms, note))
    shown = "-" if ms is None else f"{ms:.4f}"
    print(f"{section:8s} {cfg:22s} {variant:28s} {shown:>10s} ms {note}", flush=True)
    return ms


def peaked_draft(n, L, v, gen):
    """Confident drafter: one token per depth ~0.9, so trees have a long main chain."""
    x = torch.randn(n, L, v, device=DEV, generator=gen)
    top = torch.randint(0, v, (n, L, 1), device=DEV, generator=gen)
    x.scatter_(2, top, 14.0)
    return x.to(torch.bfloat16)


def first_child_rows(tree):
    """[N, B+1] token of each row's first child (or 0): the deepest greedy path."""
    n, b = tree.tokens.shape
    dev = tree.tokens.device
    node = torch.arange(b, device=dev).expand(n, b)
    valid = node < tree.num_nodes.unsqueeze(1)
    prow = torch.where(valid, tree.parents + 1, b + 1)
    first = torch.full((n, b + 2), b, dtype=torch.int64, device=dev)
    first.scatter_reduce_(1, prow, node.contiguous(), reduce="amin")
    first = first[:, : b + 1]
    tok = tree.tokens.gather(1, first.clamp(max=b - 1))
    return torch.where(first < b, tok, 0)


# ----------------------------------------------------------------------- build


def bench_build(Ns, Bs, L, V, gen, quick):
    """Tree build: the fused vocab top-K path (build_tree's default on CUDA) vs the
    previous path (torch.topk + chunked lse, same tree kernels) vs the CPU heap, eager
    and CUDA-graph replay, plus the parts and the budget controller's step."""
    backends = ["triton", "torch"] if (CUDA and HAS_TRITON) else ["torch"]
    for n in Ns:
        draft_full = peaked_draft(n, L, V, gen)
        for b in Bs:
            cfg = f"N={n} B={b}"
            draft = draft_full
            ports_reps = 1 if n * b >= 16384 else 3
            record("build", cfg, "heap/CPU (ports)", lambda: t_wall(lambda: build_tree_ports_style(draft, b),
                                                                    ports_reps))
            for be in backends:
                fn = lambda be=be: build_tree(draft, b, b, backend=be)  # noqa: E731
                record("build", cfg, f"ours {be} eager", lambda fn=fn: t_events(fn, 10 if be == "torch" else 20))
                if CUDA:
                    record("build", cfg, f"ours {be} graph", lambda fn=fn: t_graph(fn))
            if CUDA:
                def previous():  # before the fused top-K: torch.topk + row_logsumexp
                    vals, idx = torch.topk(draft, b, dim=-1, sorted=False)
                    return build_tree_from_topk(vals, idx, b, b, row_logsumexp(draft))
                record("build", cfg, "previous (torch.topk) graph", lambda: t_graph(previous))
                record("build", cfg, "previous (torch.topk) eager", lambda: t_events(previous))
                record("build", cfg, "  part: fused top-K+lse graph", lambda: t_graph(lambda: vocab_topk(draft, b)))

                def topk_only():
                    torch.topk(draft, b, dim=-1, sorted=False)
                    row_logsumexp(draft)
                record("build", cfg, "  part: torch.topk+lse graph", lambda: t_graph(topk_only))
                vals, idx, lse = vocab_topk(draft, b)
                record("build", cfg, "  part: tree+mask from top-K graph",
                       lambda: t_graph(lambda: build_tree_from_topk(vals, idx, b, b, lse)))
                record("build", cfg, "  part: chain from top-K graph",
                       lambda: t_graph(lambda: build_chain_from_topk(vals, idx, b, lse)))
                ctl = BudgetController(CostTable.load(H200_VLLM_0_20_2), b, L, device=DEV)
                record("build", cfg, "budget step eager (build+choose, 1 host read)",
                       lambda: t_wall(lambda: build_controlled(draft, ctl), 5))
        del draft_full
        if CUDA:
            torch.cuda.empty_cache()
    targets = [((1, 64), 0.15), ((32, 256), 1.1)]
    for (n, b), goal in targets:
        cfg = f"N={n} B={b}"
        got = {v.strip(): ms for sec, c, v, ms, _ in ROWS if sec == "build" and c == cfg}
        ours, heap = got.get(f"ours {backends[0]} graph"), got.get("heap/CPU (ports)")
        prev = got.get("previous (torch.topk) graph")
        if ours is None:
            continue
        verdict = "met" if ours <= goal else f"missed by {100 * (ours / goal - 1):.0f}%"
        note = f"target <= {goal} ms: {verdict}; previous path {prev:.3f} ms" if prev else f"target <= {goal} ms: {verdict}"
        if heap:
            note += f"; heap/CPU {heap:.3f} ms ({heap / ours:.1f}x)"
        ROWS.append(("build", cfg, "issue-13 target", ours, note))
        print(f"build    {cfg:22s} issue-13 target: ours graph {ours:.4f} ms, {note}", flush=True)


# ------------------------------------------------------------------------ walk


def bench_walk(Ns, Bs, L, V, gen, max_probs_bytes):
    backends = ["triton", "torch"] if (CUDA and HAS_TRITON) else ["torch"]
    for n in Ns:
        draft = peaked_draft(n, L, V, gen)
        for b in Bs:
            cfg = f"N={n} B={b}"
            tree = build_tree(draft, b, b)
            fc = first_child_rows(tree)
            am = fc.clone()
            for be in backends:
                fn = lambda be=be: walk_greedy(am, tree, backend=be)  # noqa: E731
                record("walk", cfg, f"greedy {be} eager", lambda fn=fn: t_events(fn))
                if CUDA:
                    record("walk", cfg, f"greedy {be} graph", lambda fn=fn: t_graph(fn))
            nbytes = n * (b + 1) * V * 4
            if nbytes > max_probs_bytes:
                ROWS.append(("walk", cfg, "sampled", None, f"skipped: probs tensor {nbytes / 2**30:.0f} GiB"))
                print(f"walk     {cfg:22s} sampled skipped ({nbytes / 2**30:.0f} GiB probs)")
                continue
            probs = torch.full((n, b + 1, V), 0.02 / V, device=DEV)
            probs.scatter_(2, fc.unsqueeze(2), 0.98)
            u = torch.rand(n, L + 1, device=DEV, generator=gen)
            res = walk_sampled(probs, tree, u)
            depth = res.num_accepted.float().mean().item()
            for be in backends:
                fn = lambda be=be: walk_sampled(probs, tree, u, backend=be)  # noqa: E731
                record("walk", cfg, f"sampled {be} eager", lambda fn=fn: t_events(fn, 10))
                if CUDA:
                    record("walk", cfg, f"sampled {be} graph", lambda fn=fn: t_graph(fn, 20))
            ROWS.append(("walk", cfg, "sampled mean accepted", depth, "tokens"))
            del probs
            if CUDA:
                torch.cuda.empty_cache()


# ------------------------------------------------------------------- compaction


def make_kv(n_max, b_max, layers, heads, hd, bs, ctx, layout, dtype):
    per = (ctx + b_max + 1 + bs - 1) // bs
    nb = n_max * per + 1
    if layout == "heads_packed":
        shape = (nb, heads, bs, 2 * hd)
    else:
        shape = (nb, 2, bs, heads, hd)
    return [torch.empty(shape, dtype=dtype, device=DEV) for _ in range(layers)], per, nb


def bench_compact(Ns, Bs, L, V, gen, layers, heads, hd, ctx, bs=16):
    for layout in ("heads_packed", "kv_in_block"):
        kvs, per, nb = make_kv(max(Ns), max(Bs), layers, heads, hd, bs, ctx, layout, torch.bfloat16)
        for n in Ns:
            draft = peaked_draft(n, L, V, gen)
            perm = torch.randperm(nb - 1, device=DEV, generator=gen)[: n * per].reshape(n, per).int() + 1
            start = torch.full((n,), ctx, device=DEV)
            for b in Bs:
                cfg = f"N={n} B={b}"
                tree = build_tree(draft, b, b)
                res = walk_greedy(first_child_rows(tree), tree)  # deepest path: most moves
                rows, nacc = res.accepted_rows, res.num_accepted
                for be in (["triton", "torch"] if (CUDA and HAS_TRITON) else ["torch"]):
                    fn = lambda be=be: compact_kv(kvs, perm, bs, start, rows, nacc, layout, backend=be)  # noqa
                    record("compact", cfg, f"{layout} {be} eager", lambda fn=fn: t_events(fn, 10))
                    if CUDA:
                        record("compact", cfg, f"{layout} {be} graph", lambda fn=fn: t_graph(fn, 20))
                ROWS.append(("compact", cfg, "moved tokens/request", nacc.float().mean().item(), f"{layers} layers"))
        del kvs
        if CUDA:
            torch.cuda.empty_cache()


# --------------------------------------------------------- verify forward share


class VerifyStack:
    """Qwen3-8B-shaped verify forward at batch 1: per layer RMSNorm, fused QKV,
    SDPA (GQA) over context + tree tokens with the tree mask, O proj, SwiGLU MLP;
    then the LM head.  (No RoPE / QK-norm: small elementwise ops.)"""

    def __init__(self, layers, hidden, nq, nkv, hd, inter, vocab, ctx, ntok, dtype):
        mk = lambda *s: torch.empty(*s, dtype=dtype, device=DEV).normal_(0, 0.02)  # noqa: E731
        self.cfg = (layers, hidden, nq, nkv, hd, inter, ctx, ntok)
        self.wqkv = [mk(hidden, (nq + 2 * nkv) * hd) for _ in range(layers)]
        self.wo = [mk(nq * hd, hidden) for _ in range(layers)]
        self.wgu = [mk(hidden, 2 * inter) for _ in range(layers)]
        self.wd = [mk(inter, hidden) for _ in range(layers)]
        self.lm = mk(hidden, vocab)
        self.kc = [mk(ctx + ntok, nkv, hd) for _ in range(layers)]
        self.vc = [mk(ctx + ntok, nkv, hd) for _ in range(layers)]
        self.x = mk(ntok, hidden)
        self.gqa = True

    def forward(self, mask):
        layers, hidden, nq, nkv, hd, inter, ctx, t = self.cfg
        x = self.x
        for i in range(layers):
            h = F.rms_norm(x, (hidden,))
            q, k, v = (h @ self.wqkv[i]).split([nq * hd, nkv * hd, nkv * hd], -1)
            self.kc[i][ctx:].copy_(k.view(t, nkv, hd))
            self.vc[i][ctx:].copy_(v.view(t, nkv, hd))
            qq = q.view(1, t, nq, hd).transpose(1, 2)
            kk = self.kc[i].unsqueeze(0).transpose(1, 2)
            vv = self.vc[i].unsqueeze(0).transpose(1, 2)
            if self.gqa:
                a = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
            else:
                rep = nq // nkv
                a = F.scaled_dot_product_attention(qq, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1),
                                                   attn_mask=mask)
            x = x + a.transpose(1, 2).reshape(t, nq * hd) @ self.wo[i]
            g, u = (F.rms_norm(x, (hidden,)) @ self.wgu[i]).chunk(2, -1)
            x = x + (F.silu(g) * u) @ self.wd[i]
        return F.rms_norm(x, (hidden,)) @ self.lm


def bench_share(shape, L, V, b, gen, ref_chain_ms=7.0):
    layers, hidden, nq, nkv, hd, inter, ctx = shape
    t = b + 1
    dtype = torch.bfloat16 if CUDA else torch.float32
    draft = peaked_draft(1, L, V, gen)
    tree = build_tree(draft, b, b)
    mask = torch.ones(t, ctx + t, dtype=torch.bool, device=DEV)
    mask[:, ctx:] = tree.ancestor_mask[0]
    stack = VerifyStack(layers, hidden, nq, nkv, hd, inter, V, ctx, t, dtype)
    try:
        stack.forward(mask)
    except Exception:
        stack.gqa = False
    cfg = f"N=1 B={b}"
    fwd_e = record("share", cfg, "verify forward eager", lambda: t_events(lambda: stack.forward(mask), 10))
    fwd_g = record("share", cfg, "verify forward graph", lambda: t_graph(lambda: stack.forward(mask), 20))
    del stack
    if CUDA:
        torch.cuda.empty_cache()
    kvs, per, nb = make_kv(1, b, layers, nkv, hd, 16, ctx, "heads_packed", dtype)
    bt = torch.arange(1, per + 1, device=DEV, dtype=torch.int32).unsqueeze(0)
    start = torch.full((1,), ctx, device=DEV)
    am = first_child_rows(tree)
    probs = torch.full((1, b + 1, V), 0.02 / V, device=DEV)
    probs.scatter_(2, am.unsqueeze(2), 0.98)
    u = torch.rand(1, L + 1, device=DEV, generator=gen)

    def greedy_step():
        tr = build_tree(draft, b, b)
        res = walk_greedy(am, tr)
        compact_kv(kvs, bt, 16, start, res.accepted_rows, res.num_accepted, "heads_packed")

    def sampled_step():
        tr = build_tree(draft, b, b)
        res = walk_sampled(probs, tr, u)
        compact_kv(kvs, bt, 16, start, res.accepted_rows, res.num_accepted, "heads_packed")

    ge = record("share", cfg, "build+walk+compact greedy eager", lambda: t_events(greedy_step))
    gg = record("share", cfg, "build+walk+compact greedy graph", lambda: t_graph(greedy_step))
    se = record("share", cfg, "build+walk+compact sampled eager", lambda: t_events(sampled_step))
    sg = record("share", cfg, "build+walk+compact sampled graph", lambda: t_graph(sampled_step))
    base = fwd_g or fwd_e
    if base:
        for name, v in (("greedy graph", gg), ("greedy eager", ge), ("sampled graph", sg), ("sampled eager", se)):
            if v is not None:
                ROWS.append(("share", cfg, f"share of forward: {name}", 100 * v / base, "% of measured forward"))
                ROWS.append(("share", cfg, f"share of 7.0 ms chain step: {name}", 100 * v / ref_chain_ms, "%"))
                print(f"share    {cfg:22s} {name:28s} {100 * v / base:9.2f} % of forward "
                      f"({100 * v / ref_chain_ms:.2f} % of {ref_chain_ms} ms)")


# ------------------------------------------------------------------------ main


def to_markdown(meta):
    lines = [f"Machine: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"command: `{meta['command']}`", ""]
    sections = {}
    for sec, cfg, var, ms, note in ROWS:
        sections.setdefault(sec, []).append((cfg, var, ms, note))
    for sec, rows in sections.items():
        lines += [f"### {sec}", "", "| config | variant | value | note |", "| --- | --- | ---: | --- |"]
        for cfg, var, ms, note in rows:
            val = "-" if ms is None else f"{ms:.4f}"
            lines.append(f"| {cfg} | {var.strip()} | {val} | {note or 'ms'} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="build,walk,compact,share")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    only = set(args.only.split(","))
    if args.quick:
        Ns, Bs, L, V = [1, 2], [8, 16], 4, 1000
        kv = dict(layers=2, heads=2, hd=16, ctx=32)
        shape = (2, 64, 4, 2, 16, 128, 32)
        max_probs = 1 << 30
    else:
        Ns, Bs, L, V = [1, 8, 32, 128], [16, 64, 256, 512], 15, 151936
        kv = dict(layers=36, heads=8, hd=128, ctx=512)
        shape = (36, 4096, 32, 8, 128, 12288, 512)  # Qwen3-8B
        max_probs = 16 << 30
    from ddtree_patcher.patches.ddtree.payload.core._triton import triton as _t

    meta = dict(device=torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
                torch=torch.__version__, triton=getattr(_t, "__version__", "-"),
                command="python bench/bench_core.py" + (" --quick" if args.quick else ""), quick=args.quick)
    print(meta, flush=True)
    t0 = time.time()
    if "build" in only:
        bench_build(Ns, Bs, L, V, gen, args.quick)
    if "share" in only:
        bench_share(shape, L, V, 64 if not args.quick else 16, gen)
    if "walk" in only:
        bench_walk(Ns, Bs, L, V, gen, max_probs)
    if "compact" in only:
        bench_compact(Ns, Bs, L, V, gen, **kv)
    meta["seconds"] = round(time.time() - t0, 1)
    print(f"done in {meta['seconds']} s", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "core_bench.json"), "w") as f:
            json.dump(dict(meta=meta, rows=ROWS), f, indent=1)
        with open(os.path.join(args.out, "core_bench.md"), "w") as f:
            f.write(to_markdown(meta))


if __name__ == "__main__":
    main()
