#!/usr/bin/env python3
"""What would one node budget across the batch buy?  An offline simulation (#29) with a
trained pair's real drafter (bench/realpair) and a step-cost table; no engine runs.

    python bench/batch_budget_sim.py WORK [--requests 2,4,8,16,32] [--budgets 16,32,64]
        [--rounds 5] [--batches 200] [--max-tree 256] [--cost-table FILE]

WORK: a bench/realpair/train.py output (pair/ and pair/prompts.json).  Every anchor of
the held-out greedy continuations gets the drafter's log-probs, its DDTree (the heapq
oracle, pop order, path probabilities) and the pop indices of the truth's path.  A step
is N anchors drawn at random (a batch of N requests).  Per budget B, same verify rows:

  fixed       every request a tree of B nodes (today's engine)
  batch-wide  the N * B nodes of highest path probability over the batch
              (core/batch_budget.admit: each request a prefix of its pop order, up to
              --max-tree nodes: a sure request may take more than B)

tokens = N + accepted drafts (a greedy walk against the truth).  "choice" picks the total
per step from {N * B} by expected tokens per ms (core/batch_budget.choose_total, the
drafter's own probabilities, costs from the table) against the best fixed B of the
round.  Costs come from a table (default: the shipped H200 one, vLLM 0.20.2, 8B shape):
a model of the step, not a measurement of the batch-wide step.  Prints medians (min-max)
over rounds of fresh random batches.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "realpair"))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402


def continuations(work: Path):
    """Per held-out greedy continuation of a bench/realpair/train.py output: the
    drafter's log-probs [P, L, V] and the truths [P, L] at each of its P anchors (anchor
    p: p + 1 tokens of the continuation known), in order."""
    import pair
    import train

    pdir = work / "pair"
    pj = json.load(open(pdir / "prompts.json"))
    target, _ = train.load_target(pdir / "target", "cpu")
    drafter, dcfg = pair.load_drafter(pdir / "drafter")
    block = int(dcfg["block_size"])
    mask_id = int(dcfg["dflash_config"]["mask_token_id"])
    cap = pair.AuxCapture(target, dcfg["dflash_config"]["target_layer_ids"])
    try:
        for prompt, cont in zip(pj["prompts"], pj["hf_greedy"]):
            seq = torch.tensor(prompt + cont).unsqueeze(0)
            anchors = torch.arange(len(prompt), seq.shape[1] - block + 1).unsqueeze(0)
            with torch.no_grad():
                yield train.drafter_logprobs(drafter, target, cap, seq, anchors,
                                             {"block": block}, torch.device("cpu"), mask_id)
    finally:
        cap.remove()


def anchors_of(work: Path, bmax: int):
    """Per anchor: (scores [bmax] in pop order, -inf pads; truth path pop indices)."""
    import accept

    heap_build = accept._heap_build()
    out = []
    for lps, truths in continuations(work):
        vals, toks = lps.topk(min(bmax, lps.shape[-1]), dim=-1)
        for a in range(lps.shape[0]):
            v, t, tr = vals[a].tolist(), toks[a].tolist(), truths[a].tolist()
            nodes = heap_build(v, t, bmax, neg=float("-inf"))
            sc = torch.full((bmax,), float("-inf"))
            sc[: len(nodes)] = torch.tensor([s for *_, s in nodes])
            dep = torch.zeros(bmax, dtype=torch.int64)
            dep[: len(nodes)] = torch.tensor([d for _, _, d, _ in nodes])
            out.append((sc, dep, len(nodes), accept.path_indices(v, t, tr, bmax)))
    return out


def simulate(data, requests, budgets, rounds, batches, cost_ms, seed=0):
    from ddtree_patcher.patches.ddtree.payload.core.batch_budget import admit, choose_total
    from accept import accepted_for

    rows = []
    for n in requests:
        per_round = {b: ([], []) for b in budgets}
        choice_vs_best = []
        for rd in range(rounds):
            rng = random.Random(seed * 1000 + rd * 97 + n)
            fixed = {b: 0 for b in budgets}
            wide = {b: 0 for b in budgets}
            ch_tok = ch_ms = 0.0
            for _ in range(batches):
                pick = [data[rng.randrange(len(data))] for _ in range(n)]
                scores = torch.stack([p[0] for p in pick])
                depths = torch.stack([p[1] for p in pick])
                nn = torch.tensor([p[2] for p in pick])
                for b in budgets:
                    fixed[b] += n + sum(accepted_for(p[3], b) for p in pick)
                    counts = admit(scores, nn, n * b).tolist()
                    wide[b] += n + sum(accepted_for(p[3], c) for p, c in zip(pick, counts))
                c = choose_total(scores, depths, nn, [n * b for b in budgets], cost_ms)
                ch_tok += n + sum(accepted_for(p[3], k)
                                  for p, k in zip(pick, c.counts.tolist()))
                ch_ms += c.cost_ms
            for b in budgets:
                per_round[b][0].append(fixed[b] / batches)
                per_round[b][1].append(wide[b] / batches)
            best_fixed = max(fixed[b] / (batches * cost_ms(n, n * (1 + b))) for b in budgets)
            choice_vs_best.append((ch_tok / ch_ms) / best_fixed)
        for b in budgets:
            f, w = per_round[b]
            rows.append({"requests": n, "budget": b, "fixed": f, "batch_wide": w,
                         "gain": [y / x for x, y in zip(f, w)]})
        rows.append({"requests": n, "choice_vs_best_fixed": choice_vs_best})
    return rows


def med(xs, fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("--requests", default="2,4,8,16,32")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--max-tree", type=int, default=256,
                    help="each request's tree is built this wide (the most it may keep)")
    ap.add_argument("--cost-table", default=None, help="JSON (core/budget.py CostTable "
                    "keys); default: the shipped H200 table")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    from ddtree_patcher.patches.ddtree.payload.core.batch_budget import cost_of_table
    from ddtree_patcher.patches.ddtree.payload.core.budget import CostTable

    table = CostTable.for_device("H200", args.cost_table)
    requests = [int(x) for x in args.requests.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    data = anchors_of(Path(args.work), max(args.max_tree, *budgets))
    rows = simulate(data, requests, budgets, args.rounds, args.batches,
                    cost_of_table(table))
    print(f"{len(data)} anchors; {args.rounds} rounds x {args.batches} random batches; "
          f"costs: {table.name}")
    print("| requests | B | tokens/step, fixed B each | batch-wide N*B | batch-wide / fixed |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "budget" in r:
            print(f"| {r['requests']} | {r['budget']} | {med(r['fixed'])} | "
                  f"{med(r['batch_wide'])} | {med(r['gain'], '{:.3f}')} |")
    print("\nthe choice of a total per step (expected tokens per ms) / the best fixed B:")
    for r in rows:
        if "choice_vs_best_fixed" in r:
            print(f"  {r['requests']:>3} requests: {med(r['choice_vs_best_fixed'], '{:.3f}')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"anchors": len(data), "rows": rows,
                                               "costs": table.name}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
