"""Plain-Python Algorithm 1 (heapq): the oracle for the tree builder, and the
CPU path "the way the ports do it" (GPU top-K, device-to-host copy, Python heap,
visibility matrix) used as the benchmark baseline.

Key (see tree_build): (-score, depth, key(parent), rank); the root's key is ().
"""

import heapq

import torch

if __package__.endswith(".reference"):  # imported from the checkout / the tool
    from ..payload.core.tree_build import Q_NEG, quantize_logprobs
else:  # loaded by verify as a module of the installed core it checks
    from .tree_build import Q_NEG, quantize_logprobs


def heap_build(q, tok, budget: int, neg=Q_NEG):
    """Algorithm 1 on rank-ordered lists q[d][r] (scores, non-increasing in r) and
    tok[d][r].  Entries <= neg are excluded.  Returns nodes in pop order as
    (token, parent_index, depth, score)."""
    L = len(q)
    k = min(len(q[0]), budget) if L else 0
    out = []
    heap = []
    if k and q[0][0] > neg:
        # entry: (key, depth0, rank, parent_index, parent_score, parent_key, score)
        heap.append(((-q[0][0], 1, (), 0), 0, 0, -1, 0, (), q[0][0]))
    while heap and len(out) < budget:
        key, d, r, par, pscore, pkey, s = heapq.heappop(heap)
        idx = len(out)
        out.append((tok[d][r], par, d + 1, s))
        if r + 1 < k and q[d][r + 1] > neg:
            s2 = pscore + q[d][r + 1]
            heapq.heappush(heap, ((-s2, d + 1, pkey, r + 1), d, r + 1, par, pscore, pkey, s2))
        if d + 1 < L and q[d + 1][0] > neg:
            s2 = s + q[d + 1][0]
            heapq.heappush(heap, ((-s2, d + 2, key, 0), d + 1, 0, idx, s, key, s2))
    return out


def canonical_lists(lp: torch.Tensor, k: int):
    """Full-vocab oracle ranks for one request: lp [L, V] float log-probs.

    Top-k tokens by float log-prob (ties: lower id), then rank order (q desc, id asc).
    """
    lp = lp.detach().float().cpu()
    qall = quantize_logprobs(lp)
    qs, toks = [], []
    for d in range(lp.shape[0]):
        row = lp[d].tolist()
        top = sorted(range(len(row)), key=lambda t: (-_nan_low(row[t]), t))[:k]
        pairs = sorted(((int(qall[d, t]), t) for t in top), key=lambda p: (-p[0], p[1]))
        qs.append([p[0] for p in pairs])
        toks.append([p[1] for p in pairs])
    return qs, toks


def _nan_low(x: float) -> float:
    return float("-inf") if x != x else x


def reference_tree(lp: torch.Tensor, budget: int):
    """Oracle tree for one request from full-vocab log-probs lp [L, V]."""
    k = min(budget, lp.shape[-1])
    if k == 0:
        return []
    q, t = canonical_lists(lp, k)
    return heap_build(q, t, budget)


def visibility_matrix(nodes, bmax: int):
    """numpy [bmax+1, bmax+1] bool ancestor-or-self matrix over verify rows."""
    import numpy as np

    vis = np.zeros((bmax + 1, bmax + 1), dtype=bool)
    vis[:, 0] = True
    for i in range(bmax + 1):
        vis[i, i] = True
    for i, (_, par, _, _) in enumerate(nodes):
        vis[i + 1, : i + 1] |= vis[par + 1, : i + 1]
    return vis


def _ports_heap(vals, idx, budget: int):
    """The ports' loop: flat float keys, rank tuples, Python heapq (no tie rules)."""
    L, k = len(vals), min(len(vals[0]), budget)
    nodes, heap, cnt = [], [(-vals[0][0], 0, (0,), -1, 0.0)], 1
    while heap and len(nodes) < budget:
        neg, _, ranks, parent, pscore = heapq.heappop(heap)
        d, r = len(ranks) - 1, ranks[-1]
        me = len(nodes)
        nodes.append((idx[d][r], parent, d + 1, -neg))
        if r + 1 < k:
            heapq.heappush(heap, (-(pscore + vals[d][r + 1]), cnt, ranks[:-1] + (r + 1,), parent, pscore))
            cnt += 1
        if d + 1 < L:
            heapq.heappush(heap, (neg - vals[d + 1][0], cnt, ranks + (0,), me, -neg))
            cnt += 1
    return nodes


def build_tree_ports_style(draft_logits: torch.Tensor, budget: int):
    """Baseline as the existing ports do it: log_softmax + top-K on the device, copy
    to host, Python heap per request on float scores, numpy visibility matrix, copy
    back.  Returns (tokens, parents, mask) on the input device."""
    import numpy as np

    n, L, v = draft_logits.shape
    k = min(budget, v)
    lp = torch.log_softmax(draft_logits.float(), dim=-1)
    vals, idx = torch.topk(lp, k, dim=-1)
    vals = vals.cpu().numpy().astype(np.float64)
    idx = idx.cpu().numpy()
    tokens = np.zeros((n, budget), dtype=np.int64)
    parents = np.full((n, budget), -1, dtype=np.int64)
    mask = np.zeros((n, budget + 1, budget + 1), dtype=bool)
    for b in range(n):
        nodes = _ports_heap(vals[b].tolist(), idx[b].tolist(), budget)
        for i, (t, p, _, _) in enumerate(nodes):
            tokens[b, i] = t
            parents[b, i] = p
        mask[b] = visibility_matrix(nodes, budget)
    dev = draft_logits.device
    return (torch.from_numpy(tokens).to(dev), torch.from_numpy(parents).to(dev),
            torch.from_numpy(mask).to(dev))


__all__ = ["heap_build", "canonical_lists", "reference_tree", "visibility_matrix",
           "build_tree_ports_style"]
