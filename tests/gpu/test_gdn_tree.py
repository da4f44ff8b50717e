"""Tree GDN kernels (core/gdn_tree.py) on CUDA at Qwen3.6-27B head sizes (16 key heads,
48 value heads, K = V = 128), B = 16 / 64 / 256, against the float64 per-node states
(method (a)); and replayed inside a CUDA graph.  Without CUDA they skip (small
interpreter checks live in tests/core/test_gdn_tree.py)."""

import pytest
import torch

from ddtree_patcher.patches.ddtree.payload.core import build_tree
from ddtree_patcher.patches.ddtree.payload.core.gdn_tree import (
    conv_commit,
    conv_windows,
    gdn_gates,
    tree_conv1d,
    tree_gdn_commit,
    tree_gdn_reference,
    tree_gdn_verify,
    tree_mask,
)

from .conftest import HAS_CUDA, deepest_path

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

H, HV, K, V, C, W = 16, 48, 128, 128, 2 * 16 * 128 + 48 * 128, 4


def case(n, b, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.randn(n, 15, 64, generator=gen) * 3, b, b, backend="torch")
    t = b + 1

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).cuda()

    g, beta = gdn_gates(r(n, t, HV), r(n, t, HV), r(HV, scale=0.5), r(HV, scale=0.5))
    x = dict(q=r(n, t, H, K).to(dtype), k=r(n, t, H, K).to(dtype), v=r(n, t, HV, V).to(dtype),
             g=g, beta=beta, h0=r(n, HV, K, V, scale=0.3))
    return tree, x


def path_end(tree):
    """accepted_rows / num_accepted of a walk that accepts the deepest node's path."""
    rows, num = deepest_path(tree, 16)
    return rows.cuda(), num.cuda()


@pytest.mark.parametrize("b", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_and_commit_match_float64_states(b, dtype):
    n = 2 if b == 256 else 4
    tree, x = case(n, b, dtype, seed=b)
    parents = tree.parents.cuda()
    mask = tree_mask(parents)
    o, stash = tree_gdn_verify(**x, mask=mask, scale=K ** -0.5, backend="triton")
    x64 = {k: v.double() for k, v in x.items()}
    o_ref, s_ref = tree_gdn_reference(**x64, parents=parents, scale=K ** -0.5)
    torch.testing.assert_close(o.double(), o_ref, rtol=2e-4, atol=2e-4)
    rows, num = path_end(tree)
    state = torch.empty(n, HV, V, K, device="cuda").transpose(2, 3)  # vLLM's [V, K] layout
    tree_gdn_commit(x["h0"], stash, rows, num, out=state, backend="triton")
    want = s_ref[torch.arange(n), rows.gather(1, num[:, None])[:, 0]]
    torch.testing.assert_close(state.double(), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("b", [16, 256])
def test_tree_conv_matches_torch(b):
    n = 4
    tree, _ = case(n, b, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    xs = torch.randn(n, b + 1, C, generator=gen).cuda().bfloat16()
    hist = torch.randn(n, C, W - 1, generator=gen).cuda().bfloat16()
    weight, bias = torch.randn(C, W, generator=gen).cuda(), None
    win = conv_windows(tree.parents.cuda(), W)
    y = tree_conv1d(xs, hist, weight, bias, win, backend="triton")
    y_ref = tree_conv1d(xs, hist, weight, bias, win, backend="torch")
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1e-2, atol=1e-2)
    rows, num = path_end(tree)
    new = conv_commit(xs, hist, win, rows, num)
    assert new.shape == hist.shape


def test_replays_in_a_cuda_graph():
    n, b = 4, 64
    tree, x = case(n, b, torch.bfloat16, seed=9)
    parents = tree.parents.cuda()
    rows, num = path_end(tree)
    state = torch.empty(n, HV, K, V, device="cuda")

    def step():
        mask = tree_mask(parents)
        o, stash = tree_gdn_verify(**x, mask=mask, scale=K ** -0.5, backend="triton")
        tree_gdn_commit(x["h0"], stash, rows, num, out=state, backend="triton")
        return o

    want = step().clone()
    want_state = state.clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    state.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
