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
"""

from __future__ import annotations

import torch


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
