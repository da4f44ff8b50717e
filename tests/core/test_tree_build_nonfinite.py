"""NaN / inf from a drafter: such a token is excluded (as -inf), never takes a top-K slot
and never enters the tree; torch and Triton (TRITON_INTERPRET=1 on the CPU) agree with
the heapq oracle run on the same input with those entries at -inf."""

import math

import pytest
import torch

from ddtree_patcher.patches.ddtree.payload.core import HAS_TRITON, build_tree
from ddtree_patcher.patches.ddtree.reference.heap import reference_tree

NAN, INF = math.nan, math.inf
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])
# Triton runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests/core/conftest.py)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def nodes(tree, i=0):
    k = int(tree.num_nodes[i])
    return list(zip(tree.tokens[i, :k].cpu().tolist(), tree.parents[i, :k].cpu().tolist(),
                    tree.depths[i, :k].cpu().tolist()))


def oracle(lp, budget):
    clean = torch.where(torch.isfinite(lp), lp, torch.full_like(lp, -INF))
    return [(t, p, d) for t, p, d, _ in reference_tree(clean, budget)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_does_not_take_the_only_slot(backend):
    lp = torch.tensor([[[NAN, -0.1, -2.5, -3.0]]], device=DEV)
    tree = build_tree(lp, 1, 1, logprobs=True, backend=backend)
    assert nodes(tree) == [(1, -1, 1)]  # was an empty tree: NaN took the top-1 slot
    tree = build_tree(lp, 3, 3, logprobs=True, backend=backend)
    assert nodes(tree) == [(1, -1, 1), (2, -1, 1), (3, -1, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logprobs", [True, False])
def test_nonfinite_entries_are_excluded(backend, logprobs):
    g = torch.Generator().manual_seed(3)
    n, L, v, bmax = 3, 3, 9, 8
    x = torch.randn(n, L, v, generator=g) * 3
    if logprobs:
        x = torch.log_softmax(x, -1)
    bad = torch.rand(n, L, v, generator=g)
    x[bad < 0.15] = NAN
    x[(bad >= 0.15) & (bad < 0.2)] = INF
    x[(bad >= 0.2) & (bad < 0.25)] = -INF
    x[0, 1] = NAN  # a whole depth without a usable token: the tree stops above it
    tree = build_tree(x.to(DEV), bmax, bmax, logprobs=logprobs, backend=backend)
    for i in range(n):
        lp = x[i]
        if not logprobs:
            finite = torch.where(torch.isfinite(lp), lp, torch.full_like(lp, -INF))
            lp = finite - torch.logsumexp(finite, -1, keepdim=True)
        assert nodes(tree, i) == oracle(lp, bmax), (backend, i)
        toks = {(d, t) for t, _, d in nodes(tree, i)}
        assert all(math.isfinite(float(x[i, d - 1, t])) for d, t in toks)
    assert max(d for _, _, d in nodes(tree, 0)) == 1
