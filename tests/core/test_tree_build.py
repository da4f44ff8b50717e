import random
from pathlib import Path

import pytest
import torch
from core_helpers import CUDA, DEV, TRITON_OK, assert_same_tree, needs_cuda, needs_triton, tree_nodes

from ddtree_patcher.patches.ddtree.payload.core import build_tree, build_tree_from_topk, canonical_topk
from ddtree_patcher.patches.ddtree.reference.heap import heap_build, reference_tree
from ddtree_patcher.patches.ddtree.reference.heap import build_tree_ports_style, visibility_matrix
from ddtree_patcher.patches.ddtree.payload.core.tree_build import (Q_NEG, build_chain_from_topk, candidate_pairs, num_candidates,
                                            quantize_logprobs, row_logsumexp)
from ddtree_patcher.patches.ddtree.payload.core.vocab_topk import decode_keys, order_keys, pick_sub, vocab_topk
from ddtree_patcher.patches.ddtree.payload.core.vocab_topk_split import plan


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


def _topk_oracle(x, bud, bmax, logprobs=True, lse=None):
    """Heap oracle on the very top-K lists the builder sees (the torch reference of
    vocab_topk: value desc, id asc)."""
    v = x.shape[-1]
    vals, idx, ref_lse = vocab_topk(x, min(bmax, v), with_lse=not logprobs, impl="torch")
    q, tok = canonical_topk(vals, idx, lse if lse is not None else ref_lse)
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
            # log-prob inputs: vocab_topk's rule is the full-vocab oracle's (ties: lower id)
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


# --------------------------------------------------------------- vocab top-K + lse


def _vocab_cases(g):
    """(x, k): random / exact ties / -inf / NaN / +inf / signed zeros, one and several
    chunks."""
    out = []
    for r, v, k in [(3, 7, 4), (2, 40, 16), (3, 200, 33), (1, 5000, 64), (2, 64, 64), (1, 1, 1)]:
        out.append((torch.randn(r, v, generator=g) * 3, k))
        out.append((torch.randint(0, 3, (r, v), generator=g).float(), k))
    out.append((torch.randn(2, 9000, generator=g), 1))
    x = torch.randn(4, 300, generator=g)
    x[torch.rand(4, 300, generator=g) < 0.5] = float("-inf")
    x[0, :290] = float("-inf")  # fewer finite values than k
    x[1, ::7] = float("nan")
    x[2, :40] = 0.0
    x[2, 40:80] = -0.0
    x[3, ::5] = float("inf")  # +inf is excluded like NaN (lse included)
    out.append((x, 32))
    return out


def test_order_keys_roundtrip():
    x = torch.tensor([[1.5, -2.0, 0.0, -0.0, float("-inf"), float("inf"), 1e-30, -1e-30, float("nan")]])
    key = order_keys(x)
    vals, ids = decode_keys(key)
    assert ids.tolist() == [list(range(9))]
    exp = torch.where(torch.isnan(x) | torch.isposinf(x), float("-inf"), x)
    assert torch.equal(vals, exp.abs() * torch.sign(exp).where(exp != 0, torch.ones_like(exp)))
    order = torch.argsort(key[0], descending=True).tolist()
    # +0 and -0 tie: lower id first; NaN and +inf = -inf (excluded tokens), ties by id
    assert order == [0, 6, 2, 3, 7, 1, 4, 5, 8]


def _assert_matches_reference(impl, cases, half_every):
    """vocab_topk(impl) == impl='torch' on every case: the same K tokens in key order
    (ties: lower id) from float32 (and, every half_every-th case, half) inputs with a row
    stride, and the same lse.  Returns the last strided input and its k."""
    half = torch.bfloat16 if CUDA else torch.float16  # the CPU interpreter has no bf16
    for i, (x, k) in enumerate(cases):
        for dt in (torch.float32, half) if i % half_every == 0 else (torch.float32,):
            xx = x.to(dt).to(DEV)
            wide = torch.full((xx.shape[0], xx.shape[1] + 3), 7.0, dtype=dt, device=DEV)
            wide[:, 1:-2] = xx
            xs = wide[:, 1:-2]  # row stride != V
            a = vocab_topk(xs, k, impl=impl)
            b = vocab_topk(xs, k, impl="torch")
            assert torch.equal(a[0].cpu(), b[0].cpu()) and torch.equal(a[1].cpu(), b[1].cpu()), (x.shape, k, dt)
            fin = torch.isfinite(b[2])
            assert torch.equal(fin, torch.isfinite(a[2]))
            assert torch.allclose(a[2][fin], b[2][fin], rtol=2e-6, atol=1e-6)
    return xs, k


@needs_triton
def test_vocab_topk_fused_matches_reference():
    """The fused kernels (one select program a row) pick the reference's tokens."""
    _assert_matches_reference("fused", _vocab_cases(torch.Generator().manual_seed(21)), 3)
    assert pick_sub(151936, 64) == 64 and pick_sub(151936, 256) == 32


@needs_triton
def test_vocab_topk_split_matches_reference():
    """The select spread over programs (impl='split') picks the reference's tokens: the
    cases above, plus rows whose sub-maxima fill several groups and whose sub-blocks go
    to several gather programs (the 8B drafter's shape in small: 12,000 tokens, K = 64)."""
    g = torch.Generator().manual_seed(22)
    ties = torch.randint(0, 5, (1, 12000), generator=g).float()
    ties[0, 7000:] += torch.randn(5000, generator=g)  # exact ties, then distinct values
    cases = _vocab_cases(g) + [(ties, 64)]
    shapes = {(p["ng"] > 1, p["ng2"] > 1) for p in (plan(x.shape[1], k) for x, k in cases)}
    assert shapes >= {(False, False), (True, False), (True, True)}
    xs, k = _assert_matches_reference("split", cases, 4)
    assert vocab_topk(xs, k, with_lse=False, impl="split")[2] is None
    with pytest.raises(ValueError, match="k <= 128"):
        vocab_topk(torch.zeros(1, 300, device=DEV), 129, impl="split")


@needs_triton
def test_build_tree_fused_topk():
    """build_tree through the fused top-K == the torch reference path (log-prob inputs:
    no lse, bit-identical); on logits, the same tree as the reference lists with the
    fused lse; 3-D batches [N, L, V] go through as rows."""
    g = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    for n, L, v, b, kind in [(3, 4, 50, 9, "ties"), (1, 2, 5000, 16, "peaked"), (4, 2, 30, 64, "masked")]:
        lp = _logprobs(rng, g, n, L, v, kind).to(DEV)
        bud = torch.randint(0, b + 1, (n,), generator=g).to(DEV)
        fused = build_tree(lp, bud, b, logprobs=True, topk="fused")
        ref = build_tree(lp, bud, b, logprobs=True, topk="torch", backend="torch")
        assert_same_tree(fused, ref)
        logits = lp * 1.3 + 2
        t = build_tree(logits, bud, b, topk="fused")
        _, _, lse = vocab_topk(logits, min(b, v), impl="fused")
        oracle = _topk_oracle(logits, bud.cpu(), b, logprobs=False, lse=lse)
        for i in range(n):
            assert tree_nodes(t, i) == [(a, p, d) for a, p, d, _ in oracle[i]]


def test_budget_prefix_is_the_smaller_tree():
    """The first b nodes of a budget-B tree are a valid tree (parents first) and equal
    the tree built with budget b: truncating to a smaller budget needs no rebuild."""
    g = torch.Generator().manual_seed(8)
    rng = random.Random(8)
    for kind in ("peaked", "flat", "ties", "masked"):
        lp = _logprobs(rng, g, 6, 5, 40, kind).to(DEV)
        big = build_tree(lp, 64, 64, logprobs=True, backend="torch")
        for b in (1, 5, 16, 33):
            small = build_tree(lp, b, b, logprobs=True, backend="torch")
            for i in range(6):
                k = min(b, int(big.num_nodes[i]))
                assert int(small.num_nodes[i]) == k
                nodes = tree_nodes(big, i)[:k]
                assert tree_nodes(small, i) == nodes
                assert all(p < j for j, (_, p, _) in enumerate(nodes))
                m = small.ancestor_mask[i, : k + 1, : k + 1]
                assert torch.equal(m, big.ancestor_mask[i, : k + 1, : k + 1])


def test_chain_is_the_argmax_path():
    g = torch.Generator().manual_seed(2)
    n, L, v = 4, 6, 30
    x = torch.randn(n, L, v, generator=g) * 2
    x[1, :, 3] = x[1].max(-1).values + 1  # request 1: the same argmax everywhere
    x[2, :, 5] = x[2, :, 9] = 50.0  # exact tie: the lower id (5) is the chain's
    x[3, 2] = float("-inf")  # request 3: the chain ends after depth 2
    for b in (16, 4):
        vals, idx, lse = vocab_topk(x, min(b, v), impl="torch")
        c = build_chain_from_topk(vals, idx, b, lse, backend="torch")
        m = min(L, b)
        assert c.num_nodes.tolist() == [m, m, m, min(2, m)]
        assert torch.equal(c.tokens[:3, :m], x[:3, :m].argmax(-1))
        assert (c.tokens[2, :m] == 5).all() and (c.tokens[1, :m] == 3).all()
        for i in range(n):
            k = int(c.num_nodes[i])
            assert c.parents[i, :k].tolist() == list(range(-1, k - 1))
            assert c.depths[i, :k].tolist() == list(range(1, k + 1))
            assert (c.parents[i, k:] == -1).all() and (c.tokens[i, k:] == 0).all()
            assert torch.isinf(c.scores[i, k:]).all()
            lp = torch.log_softmax(x[i], -1).max(-1).values[:k]
            q = quantize_logprobs(lp - 0.0)
            assert torch.allclose(c.scores[i, :k].double(), q.cumsum(0).double() / 2**26, atol=1e-5)
            am = c.ancestor_mask[i, : k + 1, : k + 1]
            assert torch.equal(am, torch.ones(k + 1, k + 1, dtype=torch.bool).tril())
        # the chain is a tree the same code paths understand: the torch mask agrees
        assert torch.equal(c.position_offsets[:, 1:], c.depths)


def test_no_host_sync_in_build(monkeypatch):
    """No tensor -> Python value (.item/.tolist/.cpu/.numpy/int/float/bool/index) in the
    build path: every tensor method that would sync is wrapped and reports calls from
    the core's frames (on a GPU, the CUDA-graph capture tests check the same)."""
    import sys

    core = (str(Path(build_tree.__code__.co_filename).parent),  # and the heap oracle
            str(Path(build_tree_ports_style.__code__.co_filename).parent))
    bad = []

    def spy(name):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, **k):
            f = sys._getframe(1)
            if f.f_code.co_filename.startswith(core):
                bad.append((f.f_code.co_name, f.f_lineno, name))
            return orig(self, *a, **k)
        return wrapped

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=g).to(DEV)
    bud = torch.tensor([5, 9]).to(DEV)
    runs = [dict(backend="torch", topk="torch")]
    if TRITON_OK:
        runs.append(dict(backend="triton", topk="fused"))
    for kw in runs:
        build_tree(x, bud, 9, **kw)  # warm the caches first
    names = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
    for name in names:
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    for kw in runs:
        build_tree(x, bud, 9, **kw)
        build_tree(x, 7, 9, **kw)
        vals, idx, lse = vocab_topk(x, 9, impl=kw["topk"])
        build_chain_from_topk(vals, idx, 9, lse, backend=kw["backend"])
    assert not bad, bad
    build_tree_ports_style(x, 9)  # the spy works: the host heap path copies to the host
    monkeypatch.undo()
    assert ("build_tree_ports_style", "cpu") in [(b[0], b[2]) for b in bad]


@needs_cuda
def test_cuda_fused_topk_same_tree_as_torch_topk():
    """On continuous float32 logits (no exact ties) the fused top-K picks the tokens
    torch.topk picks: with the same lse, the same tree as before the fused path."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for n, b in ((1, 64), (8, 256), (3, 512)):
        x = torch.randn(n, 15, 151936, device="cuda", generator=g) * 4
        lse = row_logsumexp(x)
        vals, idx = torch.topk(x, b, dim=-1, sorted=False)
        old = build_tree_from_topk(vals, idx, b, b, lse)
        fv, fi, flse = vocab_topk(x, b)
        assert_same_tree(old, build_tree_from_topk(fv, fi, b, b, lse))
        assert torch.allclose(flse, lse, rtol=1e-6, atol=0)
        build_tree(x, b, b)  # warm the cached tables
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
        try:
            build_tree(x, b, b)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_graphed_build_matches_eager():
    """Off CUDA GraphedBuild runs eagerly; on CUDA it replays one graph per batch
    bucket: the same trees, top-K lists and chain scores as the eager build, for
    batches below the bucket and for changing inputs."""
    from ddtree_patcher.patches.ddtree.payload.core.graphed import GraphedBuild, build_step

    g = torch.Generator(device=DEV).manual_seed(6)
    v = 151936 if CUDA else 300
    gb = GraphedBuild(64, with_chain=True, buckets=(1, 4))
    for n in (1, 3, 4, 3, 5):  # 5: above the largest bucket -> eager
        x = (torch.randn(n, 15 if CUDA else 3, v, device=DEV, generator=g) * 3)
        if CUDA:
            x = x.to(torch.bfloat16)
        got = gb(x)
        exp = build_step(x, 64, with_chain=True)
        assert_same_tree(got.tree, exp.tree)
        for f in ("vals", "idx", "lse", "chain_scores"):
            assert torch.equal(getattr(got, f), getattr(exp, f)), f
    assert len(gb.graphs) == (2 if CUDA else 0)


def test_topk_tree_graphs_replay_only_over_their_own_buffers():
    """TopkTreeGraphs (V2's VLLM_DDTREE_BUILD_GRAPHS=1): a graph per batch size reads the
    caller's static top-K buffers; after new values are written there the replay equals
    the eager build.  Other buffers, other shapes and every call off CUDA run eagerly:
    never a replay of stale inputs."""
    from ddtree_patcher.patches.ddtree.payload.core.graphed import TopkTreeGraphs

    g = torch.Generator(device=DEV).manual_seed(8)
    L, V, B = (15, 151936, 64) if CUDA else (3, 300, 16)
    tg = TopkTreeGraphs(B)
    rows = 4 * L  # the speculator's kept buffers: [max_reqs * L, K] and [max_reqs * L]
    vals_buf = torch.zeros(rows, B, device=DEV)
    idx_buf = torch.zeros(rows, B, dtype=torch.int64, device=DEV)
    lse_buf = torch.zeros(rows, device=DEV)

    def views(n):
        return (vals_buf[: n * L].view(n, L, B), idx_buf[: n * L].view(n, L, B),
                lse_buf[: n * L].view(n, L))

    assert [tg.capture(*views(n)) for n in (1, 2)] == [CUDA, CUDA]
    assert sorted(tg.graphs) == ([1, 2] if CUDA else [])
    for n in (1, 2, 3, 2, 1):  # 3: never captured -> eager
        x = torch.randn(n, L, V, device=DEV, generator=g) * 3
        v, i, s = vocab_topk(x, B)
        mine = views(n)
        for buf, new in zip(mine, (v, i, s)):
            buf.copy_(new)
        got = tg(*mine)
        assert_same_tree(got, build_tree_from_topk(v, i, B, B, s))
        # the same values elsewhere (other addresses): the eager build, same tree
        assert_same_tree(tg(v.clone(), i.clone(), s.clone()), got)
        if CUDA and n in tg.graphs:
            assert got.tokens.data_ptr() == tg.graphs[n][2].tokens.data_ptr()
        else:
            assert n not in tg.graphs


def test_topk_tree_graphs_keep_only_a_proven_capture(monkeypatch):
    """TopkTreeGraphs.capture replays a probe over the buffers and keeps the graph only
    if it gives the eager build's tree (same_tree); the buffers are restored."""
    import ddtree_patcher.patches.ddtree.payload.core.graphed as gr

    L, V, B = 3, 300, 16
    v, i, s = vocab_topk(torch.randn(2, L, V, device=DEV), B)
    t = build_tree_from_topk(v, i, B, B, s)
    assert gr.same_tree(t, build_tree_from_topk(v.clone(), i.clone(), B, B, s.clone()))
    other = build_tree_from_topk(v, i, B // 2, B, s)
    assert not gr.same_tree(t, other)
    if not CUDA:
        assert gr.TopkTreeGraphs(B).capture(v, i, s) is False
        return
    keep = [x.clone() for x in (v, i, s)]
    monkeypatch.setattr(gr, "same_tree", lambda a, b: False)
    tg = gr.TopkTreeGraphs(B)
    assert tg.capture(v, i, s) is False and not tg.graphs
    assert all(torch.equal(x, y) for x, y in zip((v, i, s), keep))
