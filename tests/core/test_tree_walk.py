import pytest
import torch
from core_helpers import CUDA, DEV, needs_cuda, needs_triton

from ddtree_patcher.patches.ddtree.payload.core import build_tree, masses, target_probs, walk_greedy, walk_sampled
from ddtree_patcher.patches.ddtree.payload.core.sampling import apply_top_k_top_p


# ----------------------------------------------------------------- scalar oracles


def _children(tree, n, row, step):
    if step >= tree.max_depth:
        return []
    k = int(tree.num_nodes[n])
    return [i for i in range(k) if int(tree.parents[n, i]) == row - 1]


def py_greedy(am, tree, n):
    cur, rows, out, step = 0, [0], [], 0
    while True:
        t = int(am[n, cur])
        ch = [i for i in _children(tree, n, cur, step) if int(tree.tokens[n, i]) == t]
        out.append(t)
        if not ch:
            return rows, out
        cur = ch[0] + 1
        rows.append(cur)
        step += 1


def py_sampled(p, tree, u, n):
    cur, rows, out, step = 0, [0], [], 0
    while True:
        m = masses(p[n, cur]).tolist()
        T = sum(m)
        t = max(min(int(float(u[n, step]) * float(T)), T - 1), 0)
        ch = _children(tree, n, cur, step)
        C = 0
        for i in ch:
            C += m[int(tree.tokens[n, i])]
            if t < C:
                out.append(int(tree.tokens[n, i]))
                cur = i + 1
                rows.append(cur)
                break
        else:
            cs = {int(tree.tokens[n, i]) for i in ch}
            acc, x = 0, len(m) - 1
            for v in range(len(m)):
                if v not in cs:
                    acc += m[v]
                    if acc > t - C:
                        x = v
                        break
            out.append(x)
            return rows, out
        step += 1


def _check(res, oracle_rows, oracle_out, n):
    k = len(oracle_out)
    assert res.accepted_rows[n, : len(oracle_rows)].tolist() == oracle_rows
    assert (res.accepted_rows[n, len(oracle_rows):] == -1).all()
    assert res.output_tokens[n, :k].tolist() == oracle_out
    assert (res.output_tokens[n, k:] == -1).all()
    assert int(res.num_accepted[n]) == k - 1


def _random_case(g, n, L, v, bmax, follow=0.7):
    draft = torch.randn(n, L, v, generator=g) * 2
    draft.scatter_add_(2, torch.randint(0, v, (n, L, 1), generator=g), torch.full((n, L, 1), 16.0))  # deeper trees
    tree = build_tree(draft, torch.randint(0, bmax + 1, (n,), generator=g), bmax, backend="torch")
    r = bmax + 1
    am = torch.randint(0, v, (n, r), generator=g)
    # make the argmax follow a random child often, so walks go deep
    valid = torch.arange(bmax).unsqueeze(0) < tree.num_nodes.unsqueeze(1)
    is_child = (tree.parents.unsqueeze(1) == torch.arange(r).view(1, r, 1) - 1) & valid.unsqueeze(1)
    prefer_first = torch.rand(n, r, bmax, generator=g) - 2.0 * torch.arange(bmax) / bmax
    pick = torch.where(is_child, prefer_first, -9.0).argmax(2)
    follow_it = is_child.any(2) & (torch.rand(n, r, generator=g) < follow)
    am = torch.where(follow_it, tree.tokens.gather(1, pick), am)
    p = torch.softmax(torch.randn(n, r, v, generator=g) * 2, -1)
    p[p < 0.03] = 0  # zero-mass tokens, unnormalised rows
    boost = torch.zeros(n, r, v)
    boost.scatter_(2, am.unsqueeze(2), 3.0)
    p = p + boost * torch.rand(n, r, 1, generator=g)
    u = torch.rand(n, L + 1, generator=g)
    u[0, :] = 0.0
    u[-1, :] = 1.0 - 2**-24
    return tree, am, p, u


def test_walks_match_scalar_oracle():
    g = torch.Generator().manual_seed(0)
    for L, v, bmax in [(1, 5, 3), (3, 6, 10), (4, 3, 20), (6, 12, 16), (2, 1, 2)]:
        tree, am, p, u = _random_case(g, 12, L, v, bmax)
        gr = walk_greedy(am, tree, backend="torch")
        sr = walk_sampled(p, tree, u, backend="torch")
        for n in range(12):
            _check(gr, *py_greedy(am, tree, n), n)
            _check(sr, *py_sampled(p, tree, u, n), n)


@needs_triton
def test_triton_walks_match_torch():
    g = torch.Generator().manual_seed(1)
    sizes = [(4, 1, 5, 3), (5, 3, 6, 10), (4, 5, 9, 16)]
    if CUDA:
        sizes += [(64, 15, 1000, 64), (4, 15, 151936, 64), (8, 15, 5000, 512)]
    for n, L, v, bmax in sizes:
        tree, am, p, u = _random_case(g, n, L, v, bmax, follow=0.9)
        tree = _to(tree, DEV)
        for dtype in (torch.float32, torch.bfloat16) if CUDA else (torch.float32,):
            pp = p.to(DEV, dtype)
            a = walk_sampled(pp, tree, u.to(DEV), backend="torch")
            b = walk_sampled(pp, tree, u.to(DEV), backend="triton")
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        a = walk_greedy(am.to(DEV), tree, backend="torch")
        b = walk_greedy(am.to(DEV), tree, backend="triton")
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        assert int(a.num_accepted.max()) >= 1


@needs_triton
def test_triton_sampled_many_chunks(monkeypatch):
    """Small chunks: the bonus search crosses chunk boundaries and skips children."""
    from ddtree_patcher.patches.ddtree.payload.core import tree_walk

    monkeypatch.setattr(tree_walk, "SUM_CHUNK", 4)
    g = torch.Generator().manual_seed(4)
    for v in (5, 37):
        tree, am, p, u = _random_case(g, 6, 4, v, 12, follow=0.5)
        tree = _to(tree, DEV)
        p, u = p.to(DEV), u.to(DEV)
        a = walk_sampled(p, tree, u, backend="torch")
        b = walk_sampled(p, tree, u, backend="triton")
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _to(tree, dev):
    import dataclasses

    return dataclasses.replace(tree, **{f.name: getattr(tree, f.name).to(dev) for f in dataclasses.fields(tree)
                                        if isinstance(getattr(tree, f.name), torch.Tensor)})


# ------------------------------------------------------- a tiny target "model"

V, L, BMAX = 4, 3, 6


def _code(seq):
    c = 0
    for i, t in enumerate(seq):
        c += (t + 1) * 5**i
    return c


class ToyModel:
    """p(. | context) and the drafter's per-depth q_d(. | context) as random tables."""

    def __init__(self, seed):
        torch.manual_seed(seed)  # Dirichlet draws from the global generator
        self.p = torch.distributions.Dirichlet(torch.full((V,), 0.8)).sample((5**6,))
        self.q = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((5**6, L))

    def joint3(self):
        out = torch.zeros(V, V, V, dtype=torch.float64)
        for a in range(V):
            for b in range(V):
                for c in range(V):
                    out[a, b, c] = (self.p[_code([])][a] * self.p[_code([a])][b] * self.p[_code([a, b])][c])
        return out.reshape(-1)


def _row_codes(tree, ctx_code, ctx_len):
    """Context code of every verify row (root = the context)."""
    n, b = tree.tokens.shape
    codes = torch.zeros(n, b + 1, dtype=torch.int64)
    codes[:, 0] = ctx_code
    for i in range(b):
        par = tree.parents[:, i] + 1
        pc = codes.gather(1, par.unsqueeze(1)).squeeze(1)
        d = tree.depths[:, i]
        codes[:, i + 1] = pc + (tree.tokens[:, i] + 1) * 5 ** (ctx_len + d - 1).clamp(min=0)
    return codes


def _emit3(model, n, seed, walker):
    """Decode until every sequence has >= 3 tokens; returns the first 3."""
    g = torch.Generator().manual_seed(seed)
    seqs = [[] for _ in range(n)]
    for _ in range(3):
        # finished sequences (>= 3 tokens) restart from the empty context
        code = torch.tensor([_code(s) if len(s) < 3 else 0 for s in seqs])
        ln = torch.tensor([len(s) if len(s) < 3 else 0 for s in seqs])
        draft = model.q[code].log()
        bud = torch.randint(1, BMAX + 1, (n,), generator=g)
        tree = build_tree(draft, bud, BMAX, logprobs=True, backend="torch")
        codes = torch.zeros(n, BMAX + 1, dtype=torch.int64)
        for k in ln.unique().tolist():
            sel = ln == k
            sub = _sub(tree, sel)
            codes[sel] = _row_codes(sub, code[sel], k)
        probs = model.p[codes]
        u = torch.rand(n, L + 1, generator=g)
        res = walker(probs, tree, u, model, code)
        for i in range(n):
            k = int(res.num_accepted[i]) + 1
            seqs[i].extend(res.output_tokens[i, :k].tolist())
    return torch.tensor([s[:3] for s in seqs])


def _sub(tree, sel):
    import dataclasses

    return dataclasses.replace(tree, **{f.name: getattr(tree, f.name)[sel] for f in dataclasses.fields(tree)
                                        if isinstance(getattr(tree, f.name), torch.Tensor)})


def _biased_walk(probs, tree, u, model, code):
    """Old TensorRT-LLM-style rule: each sibling tested with min(1, p/q) against the
    same p, one correction draw from norm(max(p - q, 0)).  Not lossless."""
    n = probs.shape[0]
    g = torch.Generator().manual_seed(int(u[0, 0] * 1e6))
    out = torch.full((n, L + 1), -1, dtype=torch.int64)
    nacc = torch.zeros(n, dtype=torch.int64)
    q = model.q[code]  # [n, L, V]
    for i in range(n):
        cur, step = 0, 0
        while True:
            p = probs[i, cur]
            ch = [c for c in range(int(tree.num_nodes[i])) if int(tree.parents[i, c]) == cur - 1] if step < L else []
            moved = False
            for c in ch:
                tok = int(tree.tokens[i, c])
                if torch.rand((), generator=g) < min(1.0, float(p[tok] / q[i, step, tok])):
                    out[i, step] = tok
                    cur, step, moved = c + 1, step + 1, True
                    break
            if not moved:
                res = (p - q[i, step]).clamp(min=0) if step < L else p
                res = res if res.sum() > 0 else p
                out[i, step] = int(torch.multinomial(res / res.sum(), 1, generator=g))
                nacc[i] = step
                break
    return type("R", (), {"output_tokens": out, "num_accepted": nacc})


def _chi2(samples, joint):
    idx = samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2]
    obs = torch.bincount(idx, minlength=V**3).double()
    exp = joint / joint.sum() * samples.shape[0]
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum().reshape(1)])
    e = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    stat = ((o - e) ** 2 / e).sum()
    p = float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2, dtype=torch.float64), stat / 2))
    try:  # scipy.stats.chisquare where available (not on the GPU image)
        from scipy.stats import chisquare
    except ImportError:
        return p
    ps = chisquare(o.numpy(), e.numpy()).pvalue
    assert abs(ps - p) <= 1e-6 + 1e-6 * ps
    return ps


def test_chi_square_lossless_and_biased():
    model = ToyModel(0)
    joint = model.joint3()

    def ours(probs, tree, u, model, code):  # the Triton kernel on CUDA
        res = walk_sampled(probs.to(DEV), _to(tree, DEV), u.to(DEV), backend="auto")
        return type(res)(*(x.cpu() for x in res))

    s = _emit3(model, 30000, 1, ours)
    p_ok = _chi2(s, joint)
    assert p_ok > 0.01, p_ok
    s_bad = _emit3(model, 2500, 2, _biased_walk)
    p_bad = _chi2(s_bad, joint)
    print("chi2 p-values: lossless", p_ok, "biased", p_bad)
    assert p_bad < 1e-4, p_bad


def test_greedy_equals_autoregressive():
    model = ToyModel(3)
    n = 200
    g = torch.Generator().manual_seed(4)
    seqs = [[] for _ in range(n)]
    while min(len(s) for s in seqs) < 6:
        code = torch.tensor([_code(s[-2:]) for s in seqs])  # a 2-token-window model
        draft = model.q[code].log()
        tree = build_tree(draft, torch.randint(1, BMAX + 1, (n,), generator=g), BMAX, logprobs=True, backend="torch")
        r = BMAX + 1
        am = torch.zeros(n, r, dtype=torch.int64)
        for i in range(n):
            for row in range(r):
                path, cur = [], row
                while cur > 0:
                    path.append(int(tree.tokens[i, cur - 1]))
                    cur = int(tree.parents[i, cur - 1]) + 1
                ctx = (seqs[i] + path[::-1])[-2:]
                am[i, row] = int(model.p[_code(ctx)].argmax())
        res = walk_greedy(am, tree, backend="torch")
        for i in range(n):
            seqs[i].extend(res.output_tokens[i, : int(res.num_accepted[i]) + 1].tolist())
    for s in seqs:
        ref = []
        for _ in range(6):
            ref.append(int(model.p[_code(ref[-2:])].argmax()))
        assert s[:6] == ref


# ------------------------------------------------------------------ target_probs


def test_target_probs_semantics():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0, -1.0]]]).repeat(4, 2, 1)
    temp = torch.tensor([0.0, 1.0, 0.5, 2.0])
    top_k = torch.tensor([5, 2, 1, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5])
    p = target_probs(logits, temp, top_k, top_p)
    assert torch.equal(p[0, 0], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))  # greedy: first argmax
    assert (p[1, :, [0, 3, 4]] == 0).all() and torch.allclose(p[1, 0, 1:3], torch.tensor([0.5, 0.5]))
    assert torch.allclose(p[2, 0, 1:3], torch.tensor([0.5, 0.5]))  # k=1 keeps ties
    assert torch.allclose(p.sum(-1), torch.ones(4, 2))
    x = logits[3, 0] / 2.0
    full = x.softmax(-1)
    kept = p[3, 0] > 0
    # top-p keeps the smallest high-probability set whose complement has mass < 1 - p
    assert kept[1] and kept[2] and full[~kept].sum() <= 0.5 + 1e-6
    assert torch.allclose(p[3, 0][kept], full[kept] / full[kept].sum())


def test_apply_top_k_top_p_matches_vllm_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 50, generator=g)
    k = torch.randint(1, 60, (64,), generator=g)
    p = torch.rand(64, generator=g)
    got = apply_top_k_top_p(x.clone(), k, p)
    # straight transcription of vLLM's apply_top_k_top_p_pytorch
    srt, idx = x.sort(dim=-1, descending=False)
    kk = torch.where(k > 50, 50, k)
    thr = srt.gather(1, (srt.size(1) - kk).unsqueeze(1))
    srt.masked_fill_(srt < thr, -float("inf"))
    cum = srt.softmax(-1).cumsum(-1)
    m = cum <= 1 - p.unsqueeze(1)
    m[:, -1] = False
    srt.masked_fill_(m, -float("inf"))
    ref = x.clone().scatter_(-1, idx, srt)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("greedy_rows", [True])
def test_sampled_walk_with_greedy_rows_equals_greedy(greedy_rows):
    g = torch.Generator().manual_seed(2)
    tree, am, p, u = _random_case(g, 10, 4, 7, 12, follow=0.9)
    logits = torch.randn(10, 13, 7, generator=g)
    logits.scatter_(2, am.unsqueeze(2), 10.0)
    probs = target_probs(logits, torch.zeros(10))
    a = walk_sampled(probs, tree, u, backend="torch")
    b = walk_greedy(logits, tree, backend="torch")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@needs_cuda
def test_walk_cuda_graph():
    g = torch.Generator().manual_seed(3)
    tree, am, p, u = _random_case(g, 8, 15, 2000, 64, follow=0.95)
    tree = _to(tree, "cuda")
    p, u, am = p.cuda(), u.cuda(), am.cuda()
    walk_sampled(p, tree, u)
    walk_greedy(am, tree)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = walk_sampled(p, tree, u)
        b = walk_greedy(am, tree)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(a, walk_sampled(p, tree, u, backend="torch")):
        assert torch.equal(x, y)
    for x, y in zip(b, walk_greedy(am, tree, backend="torch")):
        assert torch.equal(x, y)
