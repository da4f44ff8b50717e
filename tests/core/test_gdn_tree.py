"""Gated DeltaNet on a tree (core/gdn_tree.py) against the plain recurrence run along
every root-to-node path as a chain, in float64.

Trees: chains, depth-1 (all children of the root), random, DDTree-built, deep, and
siblings with identical inputs (ties); up to B = 256.  The Triton kernels run on
CUDA or, small, under TRITON_INTERPRET=1 (tests/gpu/test_gdn_tree.py: large sizes).
"""

import pytest
import torch
import torch.nn.functional as F

from core_helpers import DEV, needs_triton
from ddtree_patcher.patches.ddtree.payload.core import build_tree
from ddtree_patcher.patches.ddtree.payload.core.gdn_tree import (
    conv_commit,
    conv_windows,
    gdn_chain,
    gdn_gates,
    row_parents,
    tree_conv1d,
    tree_gdn_commit,
    tree_gdn_reference,
    tree_gdn_verify,
    tree_mask,
)

F64 = torch.float64


def make_parents(kind: str, n: int, b: int, seed: int) -> torch.Tensor:
    """[N, B] node parents (-1 = child of the root), parents before children."""
    g = torch.Generator().manual_seed(seed)
    if kind == "chain":
        return torch.arange(-1, b - 1).expand(n, b).clone()
    if kind == "depth1":
        return torch.full((n, b), -1, dtype=torch.int64)
    if kind == "ddtree":  # what the proposer builds: top-B prefixes of random drafts
        logits = torch.randn(n, min(16, max(2, b // 3)), 5, generator=g) * 2
        return build_tree(logits, b, b, backend="torch").parents.clone()
    out = torch.empty(n, b, dtype=torch.int64)
    for i in range(b):
        lo = -1 if kind == "random" else max(-1, i - 3)  # "deep": a recent parent
        out[:, i] = torch.randint(lo, i, (n,), generator=g)
    return out


def make_inputs(n, t, h, hv, kd, vd, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)

    a, b = r(n, t, hv), r(n, t, hv)
    A_log, dt_bias = r(hv, scale=0.5), r(hv, scale=0.5)
    gg, beta = gdn_gates(a, b, A_log, dt_bias)
    return dict(q=r(n, t, h, kd), k=r(n, t, h, kd), v=r(n, t, hv, vd), g=gg.to(dtype),
                beta=beta.to(dtype), h0=r(n, hv, kd, vd, scale=0.5))


def paths(parents: torch.Tensor, n: int) -> list[list[int]]:
    """Root-to-row path (verify rows) of every row of tree n."""
    prow = row_parents(parents)[n].tolist()
    out = []
    for r in range(len(prow)):
        p, x = [], r
        while x >= 0:
            p.append(x)
            x = prow[x]
        out.append(p[::-1])
    return out


def chain_per_node(x: dict, parents, scale):
    """Oracle: every row's output and state from a plain chain along its path."""
    n, t = x["q"].shape[:2]
    o = torch.empty(n, t, *x["v"].shape[2:], dtype=F64)
    s = torch.empty(n, t, *x["h0"].shape[1:], dtype=F64)
    for i in range(n):
        for r, p in enumerate(paths(parents, i)):
            sub = {k: v[i:i + 1, p] for k, v in x.items() if k != "h0"}
            oc, sc = gdn_chain(**sub, h0=x["h0"][i:i + 1], scale=scale)
            o[i, r], s[i, r] = oc[0, -1], sc[0, -1]
    return o, s


def path_rows(parents, n, row, width):
    """accepted_rows for a walk that ends at ``row``: its path, -1 padded."""
    p = paths(parents, n)[row]
    return p + [-1] * (width - len(p)), len(p) - 1


def deepest_rows(parents) -> list[int]:
    """Per tree, the last row of the longest path (a deep accept)."""
    return [max(range(parents.shape[1] + 1), key=lambda r: (len(paths(parents, i)[r]), r))
            for i in range(parents.shape[0])]


TREES = [("chain", 6), ("depth1", 7), ("random", 12), ("deep", 12), ("ddtree", 10)]


@pytest.mark.parametrize("kind,b", TREES)
def test_reference_and_verify_equal_chains_at_every_node(kind, b):
    n, h, hv, kd, vd = 2, 2, 6, 8, 4  # 3 value heads per key head
    parents = make_parents(kind, n, b, seed=b)
    x = make_inputs(n, b + 1, h, hv, kd, vd, seed=1)
    scale = kd ** -0.5
    o_ref, s_ref = chain_per_node(x, parents, scale)
    o_a, s_a = tree_gdn_reference(**x, parents=parents, scale=scale)
    torch.testing.assert_close(o_a, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_a, s_ref, rtol=1e-12, atol=1e-12)
    o_c, stash = tree_gdn_verify(**x, mask=tree_mask(parents, "torch"), scale=scale,
                                 backend="torch")
    torch.testing.assert_close(o_c, o_ref, rtol=1e-10, atol=1e-10)
    # the commit rebuilds the state of any row from the stash
    for r in range(b + 1):
        rows, a = zip(*(path_rows(parents, i, r, b + 1) for i in range(n)))
        s = tree_gdn_commit(x["h0"], stash, torch.tensor(rows), torch.tensor(a),
                            backend="torch")
        torch.testing.assert_close(s, s_ref[:, r], rtol=1e-10, atol=1e-10)


def test_a_linear_reading_of_the_tree_is_wrong():
    """The bug this module fixes: running the rows as one sequence changes every row
    off the first path (so the tests above can fail)."""
    parents = make_parents("depth1", 1, 5, 0)
    x = make_inputs(1, 6, 1, 2, 8, 4, seed=3)
    o_tree, _ = tree_gdn_reference(**x, parents=parents, scale=0.3)
    o_lin, _ = gdn_chain(**{k: v for k, v in x.items()}, scale=0.3)
    assert torch.allclose(o_tree[:, :2], o_lin[:, :2])
    assert not torch.allclose(o_tree[:, 2:], o_lin[:, 2:], atol=1e-3)


def test_siblings_with_equal_inputs_tie():
    parents = make_parents("depth1", 1, 4, 0)
    x = make_inputs(1, 5, 2, 2, 8, 8, seed=4)
    for key in ("q", "k", "v", "g", "beta"):
        x[key][:, 3] = x[key][:, 1]
    o, stash = tree_gdn_verify(**x, mask=tree_mask(parents, "torch"), scale=0.3,
                               backend="torch")
    torch.testing.assert_close(o[:, 3], o[:, 1], rtol=0, atol=1e-14)
    s1 = tree_gdn_commit(x["h0"], stash, torch.tensor([[0, 1]]), torch.tensor([1]),
                         backend="torch")
    s3 = tree_gdn_commit(x["h0"], stash, torch.tensor([[0, 3]]), torch.tensor([1]),
                         backend="torch")
    torch.testing.assert_close(s1, s3, rtol=0, atol=1e-14)


@pytest.mark.parametrize("b", [1, 64, 256])
def test_float32_verify_at_large_budgets(b):
    """float32 (what serving runs) against float64 chains along every path, B up to
    256."""
    n, h, hv, kd, vd = 2, 2, 4, 32, 32
    parents = make_parents("ddtree", n, b, seed=7)
    x = make_inputs(n, b + 1, h, hv, kd, vd, seed=5)
    o_ref, s_ref = chain_per_node(x, parents, kd ** -0.5)
    x32 = {k: v.float() for k, v in x.items()}
    o, stash = tree_gdn_verify(**x32, mask=tree_mask(parents, "torch"), scale=kd ** -0.5,
                               backend="torch")
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=2e-5)
    last = deepest_rows(parents)
    rows, a = zip(*(path_rows(parents, i, last[i], b + 1) for i in range(n)))
    s = tree_gdn_commit(x32["h0"], stash, torch.tensor(rows), torch.tensor(a),
                        backend="torch")
    want = torch.stack([s_ref[i, last[i]] for i in range(n)])
    torch.testing.assert_close(s.double(), want, rtol=1e-4, atol=2e-5)


def test_gates_follow_vllm():
    a = torch.tensor([[-30.0, 0.0, 19.0, 25.0]])
    g, beta = gdn_gates(a, a, torch.zeros(4), torch.ones(4))
    x = a + 1
    want = torch.where(x <= 20, torch.log1p(torch.exp(x)), x)
    torch.testing.assert_close(g, -want)
    torch.testing.assert_close(beta, torch.sigmoid(a))


# ------------------------------------------------------------------ convolution


def conv_chain(hist, xs, weight, bias):
    """Oracle: the plain causal conv (silu) over [history, xs]; last output."""
    seq = torch.cat([hist, xs.T], 1)  # [C, W-1+len]
    y = F.conv1d(seq[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    return F.silu(y[:, -1])


@pytest.mark.parametrize("kind,b", TREES + [("chain", 1), ("depth1", 1)])
def test_tree_conv_equals_chain_conv_at_every_node(kind, b):
    n, c, w = 2, 5, 4
    parents = make_parents(kind, n, b, seed=b + 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, b + 1, c, generator=g, dtype=F64)
    hist = torch.randn(n, c, w - 1, generator=g, dtype=F64)
    weight, bias = torch.randn(c, w, generator=g, dtype=F64), torch.randn(c, dtype=F64)
    win = conv_windows(parents, w)
    y = tree_conv1d(x, hist, weight, bias, win, backend="torch")
    for i in range(n):
        for r, p in enumerate(paths(parents, i)):
            torch.testing.assert_close(y[i, r], conv_chain(hist[i], x[i, p], weight, bias))
            rows, a = zip(*(path_rows(parents, j, r, b + 1) for j in range(n)))
            new = conv_commit(x, hist, win, torch.tensor(rows), torch.tensor(a))
            want = torch.cat([hist[i], x[i, p].T], 1)[:, -(w - 1):]
            assert torch.equal(new[i], want)


# ------------------------------------------------------------------ triton


@needs_triton
@pytest.mark.parametrize("kind,b", [("chain", 20), ("depth1", 9), ("random", 35),
                                    ("ddtree", 40), ("deep", 1)])
def test_triton_kernels_match_torch(kind, b):
    n, h, hv, kd, vd, c, w = 2, 1, 3, 16, 80, 40, 4  # two V blocks, one partial
    parents = make_parents(kind, n, b, seed=11).to(DEV)
    x = {k: v.float().to(DEV) for k, v in make_inputs(n, b + 1, h, hv, kd, vd, 12).items()}
    mask = tree_mask(parents, "torch")
    o_t, st_t = tree_gdn_verify(**x, mask=mask, scale=0.25, backend="torch")
    o_k, st_k = tree_gdn_verify(**x, mask=mask, scale=0.25, backend="triton")
    torch.testing.assert_close(o_k, o_t, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(st_k.u, st_t.u, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(st_k.G, st_t.G, rtol=1e-6, atol=1e-6)
    last = deepest_rows(parents.cpu())
    rows, a = zip(*(path_rows(parents.cpu(), i, last[i], b + 1) for i in range(n)))
    rows, a = torch.tensor(rows, device=DEV), torch.tensor(a, device=DEV)
    s_t = tree_gdn_commit(x["h0"], st_t, rows, a, backend="torch")
    out = torch.zeros(n, hv, vd, kd, device=DEV).transpose(2, 3)  # a [V, K] cache view
    tree_gdn_commit(x["h0"], st_k, rows, a, out=out, backend="triton")
    torch.testing.assert_close(out, s_t, rtol=2e-5, atol=2e-5)

    g = torch.Generator().manual_seed(3)
    xs = torch.randn(n, b + 1, c, generator=g).to(DEV, torch.bfloat16)
    hist = torch.randn(n, w - 1, c, generator=g).to(DEV, torch.bfloat16).transpose(1, 2)
    weight, bias = torch.randn(c, w, generator=g).to(DEV), torch.randn(c).to(DEV)
    win = conv_windows(parents, w)
    y_t = tree_conv1d(xs, hist, weight, bias, win, backend="torch")
    y_k = tree_conv1d(xs, hist, weight, bias, win, backend="triton")
    torch.testing.assert_close(y_k.float(), y_t.float(), rtol=1e-2, atol=1e-2)


@needs_triton
@pytest.mark.parametrize("bc,bv,warps", [(16, 16, 4), (32, 32, 8), (64, None, None)])
def test_triton_verify_launch_blocks(bc, bv, warps, monkeypatch):
    """Every launch the bench sweeps (gdn_triton.VERIFY_BLOCKS) computes the same rows:
    a 41-row tree in chunks of 16, 32 or 64 rows (3 / 2 / 1), V blocks of 16 or 32 (80
    values: a partial block), 4 or 8 warps."""
    import ddtree_patcher.patches.ddtree.payload.core.gdn_triton as gk

    monkeypatch.setitem(gk.VERIFY_BLOCKS, "bc", bc)
    monkeypatch.setitem(gk.VERIFY_BLOCKS, "bv", bv)
    monkeypatch.setitem(gk.VERIFY_BLOCKS, "warps", warps)
    n, h, hv, kd, vd = 2, 1, 3, 16, 80
    parents = make_parents("ddtree", n, 40, seed=5).to(DEV)
    x = {k: v.float().to(DEV) for k, v in make_inputs(n, 41, h, hv, kd, vd, 6).items()}
    mask = tree_mask(parents, "torch")
    o_t, st_t = tree_gdn_verify(**x, mask=mask, scale=0.25, backend="torch")
    o_k, st_k = tree_gdn_verify(**x, mask=mask, scale=0.25, backend="triton")
    torch.testing.assert_close(o_k, o_t, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(st_k.u, st_t.u, rtol=2e-5, atol=2e-5)
