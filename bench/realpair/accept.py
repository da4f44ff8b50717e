"""Offline acceptance of a drafter against the target's greedy continuation (T = 0).

For one anchor (bonus token at position P) the drafter gives log-probs lp [L, V] for
positions P+1 .. P+L and the target's continuation is truth [L]:

* chain (DFlash, k = L): accepted = number of leading depths whose argmax == truth;
* DDTree at budget B: the best tree of B nodes for the factorised drafter
  distribution (Algorithm 1, ``ddtree_patcher.patches.ddtree.reference.heap.heap_build``: the
  oracle the engine's tree builder is tested against), walked greedily: follow the
  child whose token is the truth at that depth.

tau = 1 + accepted (the bonus token), averaged over anchors (``summarize``), or over
the anchors a greedy decode of max_tokens tokens actually visits (``trajectory``: what
vLLM's counters report at T = 0, batch 1, for the same prompts and drafter).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _heap_build():
    try:
        from ddtree_patcher.patches.ddtree.reference.heap import heap_build
    except ImportError:  # run from a checkout without the package installed
        sys.path.insert(0, str(ROOT))
        from patches.ddtree.reference.heap import heap_build
    return heap_build


def chain_accepted(lp: torch.Tensor, truth: torch.Tensor) -> int:
    ok = (lp.argmax(-1) == truth).tolist()
    n = 0
    for x in ok:
        if not x:
            break
        n += 1
    return n


def path_indices(vals, toks, truth, budget: int) -> list[int]:
    """Pop indices of the truth path's nodes in the DDTree of `budget` nodes built from
    rank-ordered lists vals/toks [L][k] (k >= budget or the whole vocabulary).

    Algorithm 1 pops in score order and a parent pops before its children, so the tree
    of any smaller budget b is the first b pops: the walk accepts the leading path
    nodes whose index is < b (``accepted_for``).
    """
    heap_build = _heap_build()
    nodes = heap_build(vals, toks, budget, neg=float("-inf"))
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par, _depth, _s) in enumerate(nodes):
        children.setdefault(par, {}).setdefault(tok, i)
    cur, path = -1, []
    for t in truth:
        nxt = children.get(cur, {}).get(int(t))
        if nxt is None:
            break
        cur = nxt
        path.append(nxt)
    return path


def accepted_for(path: list[int], budget: int) -> int:
    n = 0
    for i in path:
        if i >= budget:
            break
        n += 1
    return n


def tree_accepted(lp: torch.Tensor, truth: torch.Tensor, budget: int) -> int:
    """Greedy walk of the DDTree of `budget` nodes built from lp [L, V]."""
    vals, toks = lp.float().topk(min(budget, lp.shape[-1]), dim=-1)
    return len(path_indices(vals.tolist(), toks.tolist(), truth.tolist(), budget))


def trajectory(acc: list[int], max_tokens: int) -> list[int]:
    """A greedy decode of max_tokens tokens: acc[i] = drafts accepted when the bonus
    token is output token i; returns the accepted count of every draft step taken
    (as vLLM counts them: the last step's accepts past max_tokens included)."""
    pos, steps = 0, []
    while pos < max_tokens:
        steps.append(acc[pos])
        pos += acc[pos] + 1
    return steps


def per_anchor(lps: torch.Tensor, truths: torch.Tensor, budgets) -> dict:
    """Per-anchor data of lps [A, L, V] (any device) against truths [A, L]:
    {"chain": [A] accepted, "<B>": [A] accepted, "top1": [A][L], "p_true": [A][L]}."""
    A, L = truths.shape
    top1 = lps.argmax(-1) == truths
    lp_true = lps.gather(-1, truths.unsqueeze(-1))
    out = {"chain": [chain_accepted(lps[a], truths[a]) for a in range(A)],
           "top1": top1.int().tolist(),
           # the truth's rank in the drafter's distribution per depth (0: top-1)
           "rank": (lps > lp_true).sum(-1).tolist(),
           "p_true": lp_true.squeeze(-1).float().exp().tolist()}
    bmax = max(budgets)
    vals, toks = lps.float().topk(min(bmax, lps.shape[-1]), dim=-1)
    vals, toks, tr = vals.cpu().tolist(), toks.cpu().tolist(), truths.cpu().tolist()
    paths = [path_indices(vals[a], toks[a], tr[a], bmax) for a in range(A)]
    for b in budgets:
        out[str(b)] = [accepted_for(p, b) for p in paths]
    return out


def merge(parts: list[dict]) -> dict:
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}


def _per_depth(acc, L):
    return [round(sum(c >= j for c in acc) / len(acc), 4) for j in range(1, L + 1)]


def summarize(acc: dict, budgets) -> dict:
    """per_anchor data (merged) -> chain/tree tau and per-depth rates."""
    A, L = len(acc["chain"]), len(acc["top1"][0])
    col = lambda key, j: sum(r[j] for r in acc[key]) / A  # noqa: E731
    out = {
        "anchors": A,
        "depths": L,
        # P(drafter's argmax at depth j == target), each depth on its own
        "top1_per_depth": [round(col("top1", j), 4) for j in range(L)],
        # P(chain accepts >= j drafts): what vLLM's per-position counters measure
        "chain_accept_per_depth": _per_depth(acc["chain"], L),
        "chain_tau": 1 + sum(acc["chain"]) / A,
        # mean drafter probability of the target's token per depth (calibration)
        "p_true_per_depth": [round(col("p_true", j), 4) for j in range(L)],
        # P(the truth is the drafter's r-th choice), r = 0..7, per depth and over all
        # depths: a synthetic drafter profile measured on this pair (step_bench's pNN)
        "rank_probs_per_depth": [[round(sum(r[j] == k for r in acc["rank"]) / A, 4)
                                  for k in range(8)] for j in range(L)],
        "rank_probs": [round(sum(r[j] == k for r in acc["rank"] for j in range(L)) /
                             (A * L), 4) for k in range(8)],
        "tree": {str(b): {"tau": 1 + sum(acc[str(b)]) / A,
                          "accept_per_depth": _per_depth(acc[str(b)], L),
                          **sibling_stats(acc["rank"], acc[str(b)])}
                 for b in budgets},
    }
    return out


def sibling_stats(ranks, accepted) -> dict:
    """How a tree walk of one budget uses siblings (rmagur1203/vllm-ddtree's question).

    ranks [A][L]: the truth's rank per depth; accepted [A]: the walk's accepted drafts.
    A walk step at depth d took the first child when ranks[a][d] == 0, a sibling
    otherwise.  For every accepted step followed by a depth d + 1: is the truth there
    the drafter's top-1 (``next_top1``) and did the walk accept it (``next_accepted``),
    split by whether the path so far is all first children (main path) or took a
    sibling at d.
    """
    A = len(ranks)
    left = sum(any(r[d] > 0 for d in range(n)) for r, n in zip(ranks, accepted))
    cnt = {"main": [0, 0, 0], "sibling": [0, 0, 0]}  # steps, next top-1, next accepted
    for r, n in zip(ranks, accepted):
        main = True
        for d in range(min(n, len(r) - 1)):
            main = main and r[d] == 0
            key = "main" if main else ("sibling" if r[d] > 0 else None)
            if key is None:  # first child after an earlier sibling: neither
                continue
            c = cnt[key]
            c[0] += 1
            c[1] += r[d + 1] == 0
            c[2] += n > d + 1
    rate = lambda i, k: round(cnt[k][i] / cnt[k][0], 4) if cnt[k][0] else None  # noqa: E731
    return {"leaves_first_child": round(left / A, 4) if A else None,
            "main_steps": cnt["main"][0], "sibling_steps": cnt["sibling"][0],
            "main_next_top1": rate(1, "main"), "sibling_next_top1": rate(1, "sibling"),
            "main_next_accepted": rate(2, "main"),
            "sibling_next_accepted": rate(2, "sibling")}


def trajectory_tau(acc_per_seq: list[dict], max_tokens: int, budgets) -> dict:
    """tau of greedy decodes of max_tokens tokens per sequence (acc_per_seq: per_anchor
    data of anchors 0 .. max_tokens-1 of each sequence), aggregated like vLLM's
    counters: 1 + all accepted / all draft steps."""
    out = {}
    for key in ["chain"] + [str(b) for b in budgets]:
        steps = [x for a in acc_per_seq for x in trajectory(a[key], max_tokens)]
        out[key] = {"tau": 1 + sum(steps) / len(steps), "steps": len(steps)}
    return out
