"""One node budget across the batch (issue #29), in the form vLLM's adaptive verification
takes drafts (v1/worker/gpu/spec_decode/adaptive_verification.py, 0.32 / 0.33: DSpark's
batch-wide draft budget).  Pure torch, no vllm import; not yet wired into a runner.

vLLM ranks each request's draft slots by *survival*, the running product of per-slot
confidences, admits the global top-T slots of the batch (each request keeps a prefix of
its slots) and picks T from measured step costs against the expected accepted tokens,
the sum of the admitted survivals.  A DDTree tree's nodes in pop order have
non-increasing path probabilities exp(score), and its first b nodes are the best tree of
b nodes (parents first).  So with the confidences

    c_0 = exp(score_0),   c_j = exp(score_j - score_{j-1})   (pads: 0)

survival of slot j is the path probability of node j: vLLM's global top-T admits the T
nodes of highest path probability over all requests' trees, each request a prefix of its
pop order (a tree), and the sum of the admitted survivals is DDTree's expected accepted
count E_Q[A] (the paper's sum of q over the tree's nodes), summed over the batch.  The
nodes go where they are likeliest accepted: a confident request keeps a deep tree, a
request whose drafter is flat may keep none (it still emits its bonus token).

survival_confidences(scores [N, B], num_nodes [N]) -> [N, B] float32 in [0, 1]
admit(scores, num_nodes, total) -> [N] int64: nodes each request keeps (the reference
    of vLLM's admission on path probabilities: the global top-``total``)
choose_total(scores, depths, num_nodes, totals, cost_ms, calib=None) -> BatchChoice:
    the total T (of the graph-captured totals) that maximises expected tokens per ms,
    (N + sum_r sum_d c_d Q_r(A >= d)) / cost_ms(N, N + T), each request keeping its
    admitted prefix; ties go to the smaller T.  cost_ms(n, rows): the step's cost with
    ``rows`` verify rows in all (``cost_of_table`` reads a CostTable as n requests of
    rows / n rows each).  Not yet wired into a runner (#29).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .budget import expected_by_depth


def survival_confidences(scores: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Per-slot confidences whose running product is each node's path probability
    (scores: the tree build's float32 log path probabilities in pop order, pads -inf)."""
    n, b = scores.shape
    live = torch.arange(b, device=scores.device) < num_nodes.view(n, 1)
    s = torch.where(live, scores.float(), torch.zeros_like(scores, dtype=torch.float32))
    prev = torch.cat([torch.zeros_like(s[:, :1]), s[:, :-1]], dim=1)
    # pop order: score_j <= score_{j-1}; the clamp only absorbs rounding
    conf = torch.exp(s - prev).clamp_(max=1.0)
    return torch.where(live, conf, torch.zeros_like(conf))


def admit(scores: torch.Tensor, num_nodes: torch.Tensor, total: int) -> torch.Tensor:
    """Nodes each request keeps when ``total`` nodes are spent on the batch's best by
    path probability (ties: the lower request, then the earlier node); every request
    keeps a prefix of its pop order."""
    n, b = scores.shape
    live = torch.arange(b, device=scores.device) < num_nodes.view(n, 1)
    s = torch.where(live, scores.float(), torch.full_like(scores, float("-inf"),
                                                          dtype=torch.float32))
    total = max(0, min(int(total), int(live.sum())))
    order = torch.sort(s.flatten(), descending=True, stable=True).indices[:total]
    kept = torch.zeros(n * b, dtype=torch.bool, device=scores.device)
    kept[order] = True
    return kept.view(n, b).sum(1)


@dataclass(frozen=True)
class BatchChoice:
    total: int  # the batch's node budget (the verify runs N + total rows)
    counts: torch.Tensor  # [N] nodes each request keeps (a prefix of its pop order)
    expected_tokens: float  # all requests, bonus tokens included
    cost_ms: float

    @property
    def tokens_per_ms(self) -> float:
        return self.expected_tokens / self.cost_ms


def cost_of_table(table):
    """cost_ms(n, rows) from a core.budget.CostTable: n requests of rows / n query rows
    each (a packed batch of uneven trees costed as the even batch of the same rows)."""
    return lambda n, rows: table.tree_ms(n, rows / max(1, n))


def choose_total(scores: torch.Tensor, depths: torch.Tensor, num_nodes: torch.Tensor,
                 totals, cost_ms, calib: torch.Tensor | None = None) -> BatchChoice:
    """The batch-wide budget (see the module docstring).  scores / depths: the tree
    build's [N, B] pop-order outputs; num_nodes [N]; totals: candidate totals (e.g. the
    captured total widths); calib: [L + 1] per-depth factors c_d (BudgetController's
    calibration; None: the drafter's own probabilities, c_d = 1)."""
    n, b = scores.shape
    depth = int(depths.max()) if depths.numel() else 0
    if calib is not None:
        depth = max(depth, calib.numel() - 1)
    c = torch.ones(depth + 1) if calib is None else calib.float().cpu()
    best = None
    for total in sorted({int(t) for t in totals}):
        if total < 0:
            raise ValueError(f"choose_total: a negative total {total}")
        counts = admit(scores, num_nodes, total)
        q = expected_by_depth(scores, depths, counts, depth).cpu()  # [N, depth + 1]
        expected = n + float((q[:, 1:] * c[1: depth + 1]).sum())
        # the step runs the captured width N + total, however many nodes are live
        cost = float(cost_ms(n, n + total))
        if cost <= 0:
            raise ValueError(f"choose_total: cost {cost} ms for {n} requests")
        cand = BatchChoice(total, counts, expected, cost)
        if best is None or cand.tokens_per_ms > best.tokens_per_ms * (1 + 1e-9):
            best = cand
    if best is None:
        raise ValueError("choose_total: no candidate totals")
    return best
