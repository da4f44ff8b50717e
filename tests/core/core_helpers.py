"""Shared bits for tests/core (conftest.py has already set TRITON_INTERPRET)."""

import pytest
import torch

from ddtree_patcher.patches.ddtree.payload.core._triton import HAS_TRITON, interpreting

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TRITON_OK = HAS_TRITON and (CUDA or interpreting())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs triton (CUDA or TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def tree_nodes(tree, n):
    k = int(tree.num_nodes[n])
    return list(zip(tree.tokens[n, :k].tolist(), tree.parents[n, :k].tolist(), tree.depths[n, :k].tolist()))


def assert_same_tree(a, b):
    for f in ("tokens", "parents", "depths", "num_nodes", "scores", "ancestor_mask", "position_offsets"):
        x, y = getattr(a, f), getattr(b, f)
        assert torch.equal(x.cpu(), y.cpu()), f
