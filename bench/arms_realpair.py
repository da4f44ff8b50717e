#!/usr/bin/env python3
"""The tree-vs-chain choice replayed along a trained pair's real texts (#29): its
estimates against what each arm realizes, and its tokens/ms against always-tree and
always-chain, with a real drafter and decodes that move through the text as vLLM's do.
No engine runs; step times are given (a measured pair of them), tokens are real.

    python bench/arms_realpair.py WORK [--tree-ms 10.57 --chain-ms 9.13] [--budget 64]
        [--requests 1,2] [--keep-times]

WORK: a bench/realpair/train.py output (pair/ with prompts.json's greedy
continuations).  Every position of every continuation gets the drafter's top-K (one
DFlash pass per anchor), its DDTree of B nodes (core.build_tree_from_topk), the greedy
walk against the known continuation (a node's target token is the continuation's at its
depth: the walk only moves along the continuation) and the top-1 chain's accepted
length.  A cell is R texts decoded together from their first token: each step every
request plays the arm the choice picked one step earlier (async scheduling), emits
1 + accepted and moves on by as many tokens, so each arm meets the positions its own
acceptance leads to (bench/arms_sim.py draws rows at random instead).  A tree step feeds
the worker half (sched/paired.py) its real top-K and walk.  Cells end when a text does.

Per cell and policy (the choice, always the tree, always the chain of C): tokens per ms;
per arm of the choice: steps, tokens per request-step realized and the mean estimate
published over them (bench/gpu/arms_replay.py on the lookup's trace), and the chain's
estimate against what always-chain realized on the same texts (the GPU cells' question:
the chain's estimate 0.9-1.3x DFlash's realized tau).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "realpair"))
sys.path.insert(0, str(HERE / "gpu"))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from gpu.conftest import payload_module  # noqa: E402
from gpu.test_arms import out  # noqa: E402

arms = payload_module("sched.arms")
paired = payload_module("sched.paired")
channel = payload_module("sched.channel")
core = payload_module("core")


def texts_of(work: Path, budget: int, chain: int):
    """Per continuation: top-K (vals, idx, lse [P, L, K]), the walk's output tokens and
    accepted counts [P] of the tree of ``budget``, the chain's accepted [P], where
    position p (0-based) drafts continuation[p + 1 ..] after p + 1 tokens are known."""
    from batch_budget_sim import continuations

    return [_arms_of(lps.float(), truth.long(), budget, chain)
            for lps, truth in continuations(work)]


def _arms_of(lps, truth, budget, chain):
    vals, idx, lse = core.vocab_topk(lps, budget)
    tree = core.build_tree_from_topk(vals, idx, budget, budget, lse)
    # a node's target token: the continuation's after it (the walk never leaves the
    # continuation; past the last known token the bonus is a stand-in, never compared)
    dep = tree.depths.clamp(max=truth.shape[1] - 1)
    target = torch.cat([truth[:, :1], truth.gather(1, dep)], 1)
    walk = core.walk_greedy(target, tree)
    chain_acc = (idx[..., 0] == truth).long().cumprod(1)[:, :chain].sum(1)
    return {"vals": vals, "idx": idx, "lse": lse, "out": walk.output_tokens,
            "tree_acc": walk.num_accepted, "chain_acc": chain_acc}


def cell(texts, ids, policy, ms, budget, chain, keep_times=False, prior=None, seed=0):
    """One cell: requests decode texts ``ids`` together; policy "choice", "tree" or
    "chain".  Returns (tokens, ms, lookup or None)."""
    reqs = len(ids)
    L = texts[0]["idx"].shape[1]
    ch = channel.ArmChannel()
    ex = paired.ArmExpect([reqs], chain, L, max_reqs=reqs, device="cpu", channel=ch,
                          fused=False)
    lookup = arms.ArmLookup([0] + [budget] * reqs, chain, ch)
    clock = [0.0]
    lookup.clock = lambda: clock[0] / 1000
    if keep_times and prior is not None:  # an earlier cell's step times (a running server)
        _run(prior, lookup, ex, clock, "choice", ms, budget, chain, random.Random(seed + 99))
        lookup = lookup.renew(keep_times=True)
        ex.reset()
    tokens, spent = _run([texts[i] for i in ids], lookup, ex, clock, policy, ms, budget,
                         chain, random.Random(seed))
    return tokens, spent, (lookup if policy == "choice" else None)


def _run(texts, lookup, ex, clock, policy, ms, budget, chain, rng):
    reqs = len(texts)
    names = [f"r{i}" for i in range(reqs)]
    slots, valid = torch.arange(reqs), torch.ones(reqs, dtype=torch.bool)
    pos = [0] * reqs
    tokens, spent = 0, 0.0
    k = {"tree": budget, "chain": chain}.get(policy) or lookup[reqs]
    while all(p < t["tree_acc"].numel() for p, t in zip(pos, texts)):
        nxt = {"tree": budget, "chain": chain}.get(policy) or lookup[reqs]
        rows = [(t, p) for t, p in zip(texts, pos)]
        if k == budget:
            g = lambda key: torch.stack([t[key][p] for t, p in rows])  # noqa: E731
            ex.draft(g("vals"), g("idx"), g("lse"), slots)
            acc = g("tree_acc")
            ex.verified(reqs, slots, g("out"), acc, valid)
            dt = ms[0]
        else:
            acc = torch.stack([t["chain_acc"][p] for t, p in rows])
            dt = ms[1]
        emitted = (1 + acc).tolist()
        dt *= rng.uniform(0.98, 1.02)
        clock[0] += dt
        tokens, spent = tokens + sum(emitted), spent + dt
        if policy == "choice":
            lookup.observe(*out({r: 1 + k for r in names}, {r: k for r in names}, emitted))
        pos = [p + e for p, e in zip(pos, emitted)]
        k = nxt
    return tokens, spent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("--tree-ms", type=float, default=10.57)
    ap.add_argument("--chain-ms", type=float, default=9.13)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--chain", type=int, default=15)
    ap.add_argument("--requests", default="1,2")
    ap.add_argument("--keep-times", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import arms_replay

    texts = texts_of(Path(a.work), a.budget, a.chain)
    ms = (a.tree_ms, a.chain_ms)
    rows = []
    for r in [int(x) for x in a.requests.split(",")]:
        for c in range(len(texts)):
            ids = [(c + j) % len(texts) for j in range(r)]
            prior = [texts[(c + r + j) % len(texts)] for j in range(r)]
            got = {p: cell(texts, ids, p, ms, a.budget, a.chain, a.keep_times, prior, seed=c)
                   for p in ("choice", "tree", "chain")}
            rate = {p: v[0] / v[1] for p, v in got.items()}
            rep = arms_replay.replay(list(got["choice"][2].trace))
            row = {"requests": r, "texts": ids, "rate": rate,
                   "vs_faster": rate["choice"] / max(rate["tree"], rate["chain"]),
                   "arms": {f"{k[1]}": v for k, v in rep.items()}}
            # always-chain's and always-tree's tokens per request-step on these texts
            # (steps = time / step ms: the +-2 % jitter averages out)
            for arm, step_ms in (("chain", ms[1]), ("tree", ms[0])):
                tk, spent = got[arm][0], got[arm][1]
                row[f"{arm}_realized"] = tk / r / (spent / step_ms)
            rows.append(row)
    print(table(rows, a))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def table(rows, a) -> str:
    lines = [f"B = {a.budget}, C = {a.chain}, ms tree / chain {a.tree_ms} / {a.chain_ms}, "
             f"keep_times {a.keep_times}",
             "| requests | texts | tree / chain (always) | choice / faster | tree steps: "
             "realized, estimate | chain steps: realized, estimate | always-chain realized "
             "| always-tree realized |",
             "|---:|---|---:|---:|---|---|---:|---:|"]
    for r in rows:
        t = r["arms"].get(str(a.budget), {})
        c = r["arms"].get(str(a.chain), {})

        def arm(x):
            if not x:
                return "-"
            e = x.get("expected")
            return f"{x['steps']}: {x['realized']:.2f}, " + (f"{e:.2f}" if e else "-")
        lines.append(f"| {r['requests']} | {r['texts']} | {r['rate']['tree'] / r['rate']['chain']:.3f} "
                     f"| {r['vs_faster']:.3f} | {arm(t)} | {arm(c)} | "
                     f"{r['chain_realized']:.2f} | {r['tree_realized']:.2f} |")
    for req in sorted({r["requests"] for r in rows}):
        sel = [r for r in rows if r["requests"] == req]
        lines.append(f"requests {req}: choice / faster mean {statistics.fmean(r['vs_faster'] for r in sel):.3f}"
                     f", worst {min(r['vs_faster'] for r in sel):.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
