import random

import pytest
import torch
from core_helpers import CUDA, DEV, assert_same_tree, needs_cuda, needs_triton, tree_nodes

from ddtree_patcher.core import build_tree, build_tree_from_topk, canonical_topk, heap_build, reference_tree
from ddtree_patcher.core.heap_reference import build_tree_ports_style, visibility_matrix
from ddtree_patcher.core.tree_build import Q_NEG, candidate_pairs, num_candidates, quantize_logprobs, row_logsumexp


def _logprobs(rng: random.Random, g: torch.Generator, n, L, v, kind):
    if kind == "peaked":
        x = torch.randn(n, L, v, generator=g) * 6
    elif kind == "flat":
        x = torch.randn(n, L, v, generator=g) * 0.05
    elif kind == "ties":  # few distinct values -> many exact ties
        x = torch.randint(0, 3, (n, L, v), generator=g).float()
    elif kind == "uniform":
        x = torch.zeros(n, L, v)
    else:  # "masked": some tokens -inf, sometimes whole depths
        x = torch.randn(n, L, v, generator=g) * 2
        x[torch.rand(n, L, v, generator=g) < 0.4] = float("-inf")
        x[:, :, 0] = torch.where(torch.rand(n, L, generator=g) < 0.2, float("-inf"), x[:, :, 0])
        if rng.random() < 0.3:
            x[:, rng.randrange(L)] = float("-inf")
    return torch.log_softmax(x, -1).nan_to_num(nan=float("-inf"))


def _topk_oracle(x, bud, bmax, logprobs=True):
    """Heap oracle on the very top-K lists the builder sees (same torch.topk call)."""
    v = x.shape[-1]
    vals, idx = torch.topk(x, min(bmax, v), dim=-1, sorted=False)
    q, tok = canonical_topk(vals, idx, None if logprobs else row_logsumexp(x))
    q, tok = q.cpu(), tok.cpu()
    return [heap_build(q[n].tolist(), tok[n].tolist(), int(bud[n])) for n in range(x.shape[0])]


def test_quantize():
    lp = torch.tensor([0.0, -1.0, 1e-7, -1e-9, float("-inf"), float("nan"), -70000.0, -0.5])
    q = quantize_logprobs(lp).tolist()
    assert q[0] == 0 and q[1] == -(1 << 26) and q[2] == 0 and q[3] == -1
    assert q[4] == q[5] == q[6] == Q_NEG and q[7] == -(1 << 25)


def test_candidate_pairs():
    for bmax, k in [(1, 1), (16, 16), (64, 10), (512, 512)]:
        ci, cr = candidate_pairs(bmax, k, "cpu")
        assert ((ci + 1) * (cr + 1) <= bmax).all() and (cr < k).all()
        if k == bmax:
            assert ci.numel() == num_candidates(bmax)
    assert num_candidates(512) < 3400


@pytest.mark.parametrize("seed", range(8))
def test_matches_heap_oracle(seed):
    """~2500 random cases: peaked/flat/ties/-inf, L=1, B > L*K, V < B, ragged budgets."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kinds = ["peaked", "flat", "ties", "uniform", "masked"]
    for it in range(8):
        n = 40
        L = rng.choice([1, 1, 2, 3, 4, 6, 15])
        v = rng.choice([1, 2, 3, 5, 8, 17, 40, 200])
        bmax = rng.choice([1, 2, 5, 16, 33, 64])
        kind = kinds[(it + seed) % len(kinds)]
        lp = _logprobs(rng, g, n, L, v, kind)
        bud = torch.randint(0, bmax + 1, (n,), generator=g)
        bud[0] = bmax
        tree = build_tree(lp.to(DEV), bud.to(DEV), bmax, logprobs=True, backend="torch")
        oracle = _topk_oracle(lp.to(DEV), bud, bmax)
        for i in range(n):
            exp = [(t, p, d) for t, p, d, _ in oracle[i]]
            assert tree_nodes(tree, i) == exp, (seed, it, kind, L, v, bmax, int(bud[i]))
            if v <= bmax or kind in ("peaked", "flat"):  # no tie can straddle the top-K cut
                full = [(t, p, d) for t, p, d, _ in reference_tree(lp[i], int(bud[i]))]
                assert full == exp


def test_structure_and_mask():
    g = torch.Generator().manual_seed(7)
    lp = torch.log_softmax(torch.randn(6, 5, 30, generator=g) * 3, -1)
    bud = torch.tensor([0, 1, 7, 20, 20, 3])
    t = build_tree(lp.to(DEV), bud.to(DEV), 20, logprobs=True, backend="torch")
    for n in range(6):
        k = int(t.num_nodes[n])
        assert k == int(bud[n])
        par, dep = t.parents[n].tolist(), t.depths[n].tolist()
        for i in range(k):
            assert par[i] < i
            assert dep[i] == (1 if par[i] < 0 else dep[par[i]] + 1)
        sc = t.scores[n, :k]
        assert (sc[1:] <= sc[:-1]).all()  # pop order = descending score
        assert (t.tokens[n, k:] == 0).all() and (t.parents[n, k:] == -1).all() and (t.depths[n, k:] == 0).all()
        assert torch.isinf(t.scores[n, k:]).all()
        assert t.position_offsets[n, 0] == 0 and torch.equal(t.position_offsets[n, 1:], t.depths[n])
        nodes = [(0, p, 0, 0) for p in par[:k]]
        assert (t.ancestor_mask[n].cpu().numpy() == visibility_matrix(nodes, 20)).all()


def test_realistic_size_torch():
    g = torch.Generator().manual_seed(3)
    v = 151936
    logits = (torch.randn(2, 15, v, generator=g) * 4).to(torch.bfloat16)
    bud = torch.tensor([256, 64])
    x = logits.to(DEV)
    t = build_tree(x, bud.to(DEV), 256, backend="torch")
    oracle = _topk_oracle(x, bud, 256, logprobs=False)
    for n in range(2):
        assert int(t.num_nodes[n]) == int(bud[n])
        assert tree_nodes(t, n) == [(a, b, c) for a, b, c, _ in oracle[n]]


def test_ports_style_matches_on_continuous_inputs():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 6, 500, generator=g) * 3
    tok, par, mask = build_tree_ports_style(logits, 32)
    t = build_tree(logits, 32, 32, backend="torch")
    assert torch.equal(tok, t.tokens) and torch.equal(par, t.parents) and torch.equal(mask, t.ancestor_mask)


def _triton_cases(big):
    g = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    cases = []
    sizes = [(3, 1, 7, 4), (2, 4, 20, 16), (3, 3, 5, 12), (2, 6, 40, 9), (1, 2, 1, 3)]
    if big:
        sizes += [(8, 15, 151936, 64), (4, 15, 151936, 512), (32, 15, 5000, 256), (64, 15, 151936, 16)]
    for i, (n, L, v, b) in enumerate(sizes):
        kind = ["peaked", "ties", "masked", "flat", "uniform"][i % 5]
        lp = _logprobs(rng, g, n, L, v, kind)
        bud = torch.randint(0, b + 1, (n,), generator=g)
        bud[0] = b
        cases.append((lp, bud, b))
    return cases


@needs_triton
def test_triton_matches_torch():
    for i, (lp, bud, b) in enumerate(_triton_cases(CUDA)):
        # big CUDA cases only as logits (the benchmark's kernel variant: fewer compiles)
        for logprobs in ((True, False) if (CUDA and i < 5) else (i % 2 == 0,)):
            x = (lp if logprobs else lp * 1.7 + 3).to(DEV)
            if i >= 5:
                x = x.to(torch.bfloat16)  # like the benchmark (shares its compiled kernels)
            a = build_tree(x, bud.to(DEV), b, logprobs=logprobs, backend="torch")
            t = build_tree(x, bud.to(DEV), b, logprobs=logprobs, backend="triton")
            assert_same_tree(a, t)


@needs_triton
def test_triton_bf16_and_from_topk():
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 3, 64, generator=g) * 3).to(torch.bfloat16).to(DEV)
    a = build_tree(x, torch.tensor([5, 9], device=DEV), 9, backend="torch")
    t = build_tree(x, torch.tensor([5, 9], device=DEV), 9, backend="triton")
    assert_same_tree(a, t)
    vals, idx = torch.topk(x.float(), 9, dim=-1)
    u = build_tree_from_topk(vals.log_softmax(-1), idx, 9, 9, backend="triton")
    assert u.tokens.shape == (2, 9)


@needs_cuda
def test_cuda_graph_capture():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 15, 151936, device="cuda", generator=g)
    bud = torch.full((8,), 64, device="cuda")
    eager = build_tree(x, bud, 64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        build_tree(x, bud, 64)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_tree(x, bud, 64)
    x.copy_(torch.randn(8, 15, 151936, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert_same_tree(out, build_tree(x, bud, 64))
    assert not torch.equal(out.tokens, eager.tokens)
