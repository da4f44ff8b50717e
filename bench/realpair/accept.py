"""Offline acceptance of a drafter against the target's greedy continuation (T = 0).

For one anchor (bonus token at position P) the drafter gives log-probs lp [L, V] for
positions P+1 .. P+L and the target's continuation is truth [L]:

* chain (DFlash, k = L): accepted = number of leading depths whose argmax == truth;
* DDTree at budget B: the best tree of B nodes for the factorised drafter
  distribution (Algorithm 1, ``ddtree_patcher.core.heap_reference.heap_build``: the
  oracle the engine's tree builder is tested against), walked greedily: follow the
  child whose token is the truth at that depth.

tau = 1 + accepted (the bonus token), averaged over anchors.  These are the numbers
vLLM should report at T = 0 along a decode; the engine visits the anchors its own
steps land on, so the two agree in expectation, not exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _heap_build():
    try:
        from ddtree_patcher.core.heap_reference import heap_build
    except ImportError:  # run from a checkout without the package installed
        sys.path.insert(0, str(ROOT))
        from ddtree_patcher.core.heap_reference import heap_build
    return heap_build


def chain_accepted(lp: torch.Tensor, truth: torch.Tensor) -> int:
    ok = (lp.argmax(-1) == truth).tolist()
    n = 0
    for x in ok:
        if not x:
            break
        n += 1
    return n


def tree_accepted(lp: torch.Tensor, truth: torch.Tensor, budget: int) -> int:
    """Greedy walk of the DDTree of `budget` nodes built from lp [L, V]."""
    heap_build = _heap_build()
    k = min(budget, lp.shape[-1])
    vals, toks = lp.float().topk(k, dim=-1)  # sorted: non-increasing per depth
    nodes = heap_build(vals.tolist(), toks.tolist(), budget, neg=float("-inf"))
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par, _depth, _s) in enumerate(nodes):
        children.setdefault(par, {}).setdefault(tok, i)
    cur, n = -1, 0
    for t in truth.tolist():
        nxt = children.get(cur, {}).get(int(t))
        if nxt is None:
            break
        cur, n = nxt, n + 1
    return n


def summarize(lps: torch.Tensor, truths: torch.Tensor, budgets) -> dict:
    """lps [A, L, V] log-probs, truths [A, L] -> chain/tree tau, per-depth rates."""
    A, L = truths.shape
    top1 = (lps.argmax(-1) == truths).float()
    chain = [chain_accepted(lps[a], truths[a]) for a in range(A)]
    out = {
        "anchors": A,
        "depths": L,
        # P(drafter's argmax at depth j == target), each depth on its own
        "top1_per_depth": [round(float(x), 4) for x in top1.mean(0)],
        # P(chain accepts >= j drafts): what vLLM's per-position counters measure
        "chain_accept_per_depth": [round(sum(c >= j for c in chain) / A, 4)
                                   for j in range(1, L + 1)],
        "chain_tau": 1 + sum(chain) / A,
        # mean drafter probability of the target's token per depth (calibration)
        "p_true_per_depth": [round(float(x), 4) for x in
                             lps.gather(-1, truths.unsqueeze(-1)).squeeze(-1).exp().mean(0)],
        "tree": {},
    }
    for b in budgets:
        acc = [tree_accepted(lps[a], truths[a], b) for a in range(A)]
        out["tree"][str(b)] = {
            "tau": 1 + sum(acc) / A,
            "accept_per_depth": [round(sum(c >= j for c in acc) / A, 4)
                                 for j in range(1, L + 1)],
        }
    return out
