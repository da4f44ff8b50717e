"""The CUDA GDN tree path (payload gdn_cuda.py) with the layer, metadata and caches laid
out as vLLM 0.32 / 0.33 hands them to ``_forward_core``: trees, a chain row (no tree),
a ragged batch, padding rows and a roots-only step, against the plain recurrence and
causal conv along every node's own path in float64 (core.gdn_tree.gdn_chain).  Runs
with torch and with the Triton kernels (the interpreter on the CPU)."""

from types import SimpleNamespace

import pytest
import torch

from .conftest import deepest_path, device, payload_module

H, HV, K, V, W = 2, 4, 16, 16, 4
C = 2 * H * K + HV * V
SLOTS = 8


def _mods():
    return payload_module("gdn.cuda"), payload_module("core.gdn_tree"), \
        payload_module("core")


class Layer(torch.nn.Module):
    def __init__(self, dev, dtype, gen):
        super().__init__()
        self.prefix = "model.layers.0.linear_attn"
        self.tp_size, self.num_k_heads, self.num_v_heads = 1, H, HV
        self.head_k_dim, self.head_v_dim = K, V
        self.key_dim, self.value_dim = H * K, HV * V
        self.activation = "silu"
        self.conv1d = torch.nn.Conv1d(C, C, W, groups=C, bias=True).to(dev, dtype)
        with torch.no_grad():
            self.conv1d.weight.copy_(torch.randn(C, 1, W, generator=gen) * 0.5)
            self.conv1d.bias.copy_(torch.randn(C, generator=gen) * 0.1)
        self.A_log = (torch.randn(HV, generator=gen) * 0.5).to(dev)
        self.dt_bias = (torch.randn(HV, generator=gen) * 0.5).to(dev)
        conv = torch.randn(SLOTS, C, W - 1, generator=gen).to(dev, dtype)
        ssm = (torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3).to(dev)  # [V, K]
        self.kv_cache = (conv, ssm)


class TreeState:
    def __init__(self, max_reqs, rows, dev):
        self.rows = rows
        self.has_tree = torch.zeros(max_reqs, dtype=torch.int32, device=dev)
        self.mask = torch.zeros(max_reqs, rows, rows, dtype=torch.int8, device=dev)


def reference(layer, x, a, b, hist, h0, path):
    """float64: the output at the end of ``path`` (token rows, root first) and the
    state and conv history after it, by the plain recurrence."""
    _, gt, _ = _mods()
    seq = torch.cat([hist.T.double(), x[path].double()], 0)  # [W-1+P, C]
    wt = layer.conv1d.weight.view(C, W).double()
    y = torch.stack([(seq[i: i + W] * wt.T).sum(0) for i in range(len(path))])
    y = torch.nn.functional.silu(y + layer.conv1d.bias.double())
    q = y[:, : H * K].view(1, -1, H, K)
    k = y[:, H * K: 2 * H * K].view(1, -1, H, K)
    v = y[:, 2 * H * K:].view(1, -1, HV, V)
    g, beta = gt.gdn_gates(a[path].double(), b[path].double(), layer.A_log.double(),
                           layer.dt_bias.double())
    o, states = gt.gdn_chain(q, k, v, g[None].double(), beta[None].double(),
                             h0.double()[None], scale=K ** -0.5)
    return o[0, -1], states[0, -1], seq[-(W - 1):].T


def paths(parents, n_nodes):
    """Verify-row path (0 first) of every row."""
    out = [[0]]
    for node in range(n_nodes):
        p = int(parents[node])
        out.append(out[p + 1] + [node + 1])
    return out


@pytest.mark.parametrize("backend,B", [("torch", 6), ("triton", 6), ("triton", 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_and_commit_match_the_recurrence(backend, B, dtype, monkeypatch):
    """B = 20: 21 rows, two chunks of the verify kernel, with a ragged request's pads."""
    cuda, gt, core = _mods()
    dev = device() if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(7)
    layer = Layer(dev, dtype, gen)
    ts = TreeState(4, B + 1, dev)
    tree = core.build_tree(torch.randn(2, 4, 32, generator=gen) * 2, B, B, backend="torch")
    # request 0: a tree of B; request 1: 3 drafts as a chain (no tree); request 2: the
    # first 4 nodes of another tree; request 3: padding (FULL-graph style, no tokens)
    specs = [(tree.parents[0], B, True), (torch.arange(-1, 2), 3, False),
             (tree.parents[1, :4], 4, True)]
    lens = [1 + d for _, d, _ in specs] + [0]
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev)
    tokens = int(qsl[-1])
    for r, (par, d, has) in enumerate(specs):
        if has:
            ts.has_tree[r] = 1
            m = gt.tree_mask(par[None].to(dev).long())[0]
            ts.mask[r, : d + 1, : d + 1] = m.to(torch.int8)
    slots = torch.tensor([[3], [1], [5], [0]], device=dev)
    md = SimpleNamespace(num_spec_decodes=4, uniform_spec_sequence_length=None,
                         num_spec_decode_tokens=tokens, num_prefills=0, num_decodes=0,
                         spec_query_start_loc=qsl.int(), spec_state_indices_tensor=slots,
                         spec_sequence_masks_cpu=None)
    x = (torch.randn(tokens, C, generator=gen)).to(dev, dtype)
    a = torch.randn(tokens, HV, generator=gen).to(dev, dtype)
    b = torch.randn(tokens, HV, generator=gen).to(dev, dtype)
    gdn = cuda.GDNTree({layer.prefix: layer}, ts, max_tokens=64, max_reqs=4, depth=4,
                       device=dev)
    gdn.backend = backend
    monkeypatch.setattr(cuda, "_dim_first", lambda: True)
    conv0, ssm0 = (t.clone() for t in layer.kv_cache)
    gdn.note_step()
    out = cuda.tree_spec_forward(layer, md, x, b, a, layer.kv_cache[0], layer.kv_cache[1])
    assert out.shape == (1, tokens, HV, V)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == torch.float32 else dict(rtol=3e-2,
                                                                            atol=3e-2)
    accept = [None] * 3
    for r, (par, d, has) in enumerate(specs):
        s = int(slots[r, 0])
        for row, p in enumerate(paths(par, d)):
            toks = [int(qsl[r]) + i for i in p]
            o, state, hist = reference(layer, x, a, b, conv0[s], ssm0[s].transpose(-1, -2),
                                       toks)
            torch.testing.assert_close(out[0, toks[-1]].double(), o, **tol)
            if row == d // 2:  # the path this request accepts
                accept[r] = (p, state, hist)
    # the caches are untouched until the commit
    assert torch.equal(layer.kv_cache[0], conv0) and torch.equal(layer.kv_cache[1], ssm0)
    L1 = 5
    rows = torch.full((4, L1), -1, dtype=torch.int64, device=dev)
    num = torch.zeros(4, dtype=torch.int64, device=dev)
    for r, (p, _, _) in enumerate(accept):
        rows[r, : len(p)] = torch.tensor(p)
        num[r] = len(p) - 1
    rows[3, 0] = 0
    gdn.commit(rows, num, 3)
    for r, (p, state, hist) in enumerate(accept):
        s = int(slots[r, 0])
        torch.testing.assert_close(layer.kv_cache[1][s].transpose(-1, -2).double(), state,
                                   **tol)
        torch.testing.assert_close(layer.kv_cache[0][s].double(), hist, **tol)
    for s in (0, 2, 4, 6, 7):  # slots of no request (0: the null block) stay as they were
        assert torch.equal(layer.kv_cache[1][s], ssm0[s])
        assert torch.equal(layer.kv_cache[0][s], conv0[s])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_roots_only_step_commits_at_once(backend):
    cuda, gt, _ = _mods()
    dev = device() if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(1)
    layer = Layer(dev, torch.float32, gen)
    ts = TreeState(2, 5, dev)
    slots = torch.tensor([[2], [6]], device=dev)
    md = SimpleNamespace(num_spec_decodes=2, uniform_spec_sequence_length=1,
                         num_spec_decode_tokens=2, num_prefills=0, num_decodes=0,
                         spec_query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32,
                                                           device=dev),
                         spec_state_indices_tensor=slots, spec_sequence_masks_cpu=None)
    x, a, b = (torch.randn(2, d, generator=gen).to(dev) for d in (C, HV, HV))
    gdn = cuda.GDNTree({layer.prefix: layer}, ts, max_tokens=8, max_reqs=2, depth=4,
                       device=dev)
    gdn.backend = backend
    conv0, ssm0 = (t.clone() for t in layer.kv_cache)
    out = cuda.tree_spec_forward(layer, md, x, b, a, *layer.kv_cache)
    for r in range(2):
        s = int(slots[r, 0])
        o, state, hist = reference(layer, x, a, b, conv0[s], ssm0[s].transpose(-1, -2), [r])
        torch.testing.assert_close(out[0, r].double(), o, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(layer.kv_cache[1][s].transpose(-1, -2).double(), state,
                                   rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(layer.kv_cache[0][s].double(), hist)


def test_mixed_batch_maps_spec_rows_to_batch_rows(monkeypatch):
    """A batch with a prefill between the speculative requests: the tree state and the
    walk are read at the speculative rows' batch rows."""
    cuda, gt, core = _mods()
    gen = torch.Generator().manual_seed(3)
    layer = Layer("cpu", torch.float32, gen)
    ts = TreeState(3, 4, "cpu")
    par = torch.tensor([-1, 0, 0])  # root -> two siblings and a grandchild? no: 2 kids
    ts.has_tree[2] = 1
    ts.mask[2] = gt.tree_mask(par[None])[0].to(torch.int8)
    # batch rows: 0 = spec (chain of 1 draft), 1 = prefill, 2 = spec (tree of 3)
    qsl = torch.tensor([0, 2, 6], dtype=torch.int32)  # spec tokens only
    md = SimpleNamespace(num_spec_decodes=2, uniform_spec_sequence_length=None,
                         num_spec_decode_tokens=6, num_prefills=1, num_decodes=0,
                         spec_query_start_loc=qsl,
                         spec_state_indices_tensor=torch.tensor([[4], [7]]),
                         spec_sequence_masks_cpu=torch.tensor([True, False, True]))
    x, a, b = torch.randn(6, C, generator=gen), torch.randn(6, HV, generator=gen), \
        torch.randn(6, HV, generator=gen)
    gdn = cuda.GDNTree({layer.prefix: layer}, ts, max_tokens=16, max_reqs=3, depth=3,
                       device="cpu")
    monkeypatch.setattr(cuda, "_dim_first", lambda: True)
    conv0, ssm0 = (t.clone() for t in layer.kv_cache)
    gdn.note_step()
    out = cuda.tree_spec_forward(layer, md, x, b, a, *layer.kv_cache)
    # batch row 2's node 2 (row 3) is a child of node 0 (row 1), not of node 1
    o, _, _ = reference(layer, x, a, b, conv0[7], ssm0[7].transpose(-1, -2), [2, 3, 5])
    torch.testing.assert_close(out[0, 5].double(), o, rtol=2e-4, atol=2e-4)
    rows = torch.tensor([[0, 1, -1], [0, 0, 0], [0, 1, 3]])
    num = torch.tensor([1, 0, 2])
    gdn.commit(rows, num, 3)
    _, s0, _ = reference(layer, x, a, b, conv0[4], ssm0[4].transpose(-1, -2), [0, 1])
    _, s2, h2 = reference(layer, x, a, b, conv0[7], ssm0[7].transpose(-1, -2), [2, 3, 5])
    torch.testing.assert_close(layer.kv_cache[1][4].transpose(-1, -2).double(), s0,
                               rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(layer.kv_cache[1][7].transpose(-1, -2).double(), s2,
                               rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(layer.kv_cache[0][7].double(), h2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_plan_per_forward_across_layers_with_their_own_metadata(backend, monkeypatch):
    """vLLM gives a hybrid's GDN layers a KV cache group, and so a metadata object, each
    (different state slots, the same batch): the step's plan is built once per forward
    (by the first layer; vLLM's forward context is the scope) and every layer still
    reads and commits its own slots."""
    cuda, gt, core = _mods()
    dev = device() if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(11)
    layers = [Layer(dev, torch.float32, gen) for _ in range(2)]
    layers[1].prefix = "model.layers.1.linear_attn"
    B, n = 5, 2
    ts = TreeState(n, B + 1, dev)
    tree = core.build_tree(torch.randn(n, 4, 32, generator=gen) * 2, B, B, backend="torch")
    for r in range(n):
        ts.has_tree[r] = 1
        ts.mask[r] = gt.tree_mask(tree.parents[r: r + 1].to(dev).long())[0].to(torch.int8)
    t = B + 1
    qsl = torch.arange(0, n * t + 1, t, dtype=torch.int32, device=dev)
    slots = ([[2], [6]], [[5], [1]])
    mds = [SimpleNamespace(num_spec_decodes=n, uniform_spec_sequence_length=t,
                           num_spec_decode_tokens=n * t, num_prefills=0, num_decodes=0,
                           spec_query_start_loc=qsl, spec_sequence_masks_cpu=None,
                           spec_state_indices_tensor=torch.tensor(s, device=dev))
           for s in slots]
    gdn = cuda.GDNTree({lay.prefix: lay for lay in layers}, ts, max_tokens=32,
                       max_reqs=n, depth=B, device=dev)
    gdn.backend = backend
    monkeypatch.setattr(cuda, "_dim_first", lambda: True)
    built = []
    real = cuda.windows_from_mask
    monkeypatch.setattr(cuda, "windows_from_mask", lambda *a: built.append(1) or real(*a))
    forward = SimpleNamespace()  # this forward's scope (vLLM: the forward context)
    monkeypatch.setattr(cuda, "step_scope", lambda md: forward)
    start = [[c.clone() for c in lay.kv_cache] for lay in layers]
    xs = [[torch.randn(n * t, d, generator=gen).to(dev) for d in (C, HV, HV)]
          for _ in layers]
    gdn.note_step()
    outs = [cuda.tree_spec_forward(lay, md, x, b, a, *lay.kv_cache)
            for lay, md, (x, a, b) in zip(layers, mds, xs)]
    assert len(built) == 1
    rows, num = deepest_path(tree, B + 1)
    gdn.commit(rows.to(dev), num.to(dev), n)
    for lay, md, (x, a, b), out, (conv0, ssm0) in zip(layers, mds, xs, outs, start):
        for r in range(n):
            s = int(md.spec_state_indices_tensor[r, 0])
            path = [r * t + i for i in rows[r, : int(num[r]) + 1].tolist()]
            o, state, hist = reference(lay, x, a, b, conv0[s], ssm0[s].transpose(-1, -2),
                                       path)
            torch.testing.assert_close(out[0, path[-1]].double(), o, rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(lay.kv_cache[1][s].transpose(-1, -2).double(),
                                       state, rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(lay.kv_cache[0][s].double(), hist)
    # a new forward builds a new plan
    forward = SimpleNamespace()
    cuda.tree_spec_forward(layers[0], mds[0], *xs[0][:1], xs[0][2], xs[0][1],
                           *layers[0].kv_cache)
    assert len(built) == 2


@pytest.mark.parametrize("seed", range(4))
def test_windows_from_mask_equal_conv_windows(seed):
    cuda, gt, core = _mods()
    gen = torch.Generator().manual_seed(seed)
    tree = core.build_tree(torch.randn(3, 6, 16, generator=gen) * 2, 12, 12,
                           backend="torch")
    parents = tree.parents.long()
    for w in (2, 4):
        want = gt.conv_windows(parents, w)
        got = cuda.windows_from_mask(gt.tree_mask(parents), w)
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_commit_graph_replay_equals_the_eager_commit(monkeypatch):
    """The commit of all layers after the walk: a batch size's first commit runs eagerly
    and is captured, the next replays the graph; both give the same caches."""
    cuda, gt, core = _mods()
    gen = torch.Generator().manual_seed(5)
    layer = Layer("cuda", torch.bfloat16, gen)
    B, n = 12, 2
    ts = TreeState(n, B + 1, "cuda")
    tree = core.build_tree(torch.randn(n, 4, 32, generator=gen) * 2, B, B, backend="torch")
    for r in range(n):
        ts.has_tree[r] = 1
        ts.mask[r] = gt.tree_mask(tree.parents[r: r + 1].cuda().long())[0].to(torch.int8)
    t = B + 1
    qsl = torch.arange(0, n * t + 1, t, dtype=torch.int32, device="cuda")
    md = SimpleNamespace(num_spec_decodes=n, uniform_spec_sequence_length=t,
                         num_spec_decode_tokens=n * t, num_prefills=0, num_decodes=0,
                         spec_query_start_loc=qsl,
                         spec_state_indices_tensor=torch.tensor([[2], [6]], device="cuda"),
                         spec_sequence_masks_cpu=None)
    x, a, b = (torch.randn(n * t, d, generator=gen).to("cuda", torch.bfloat16)
               for d in (C, HV, HV))
    gdn = cuda.GDNTree({layer.prefix: layer}, ts, max_tokens=64, max_reqs=n, depth=4,
                       device="cuda")
    monkeypatch.setattr(cuda, "_dim_first", lambda: True)
    start = [c.clone() for c in layer.kv_cache]
    rows, num = (x.cuda() for x in deepest_path(tree, 5))
    after = []
    for _ in range(2):
        for c, s in zip(layer.kv_cache, start):
            c.copy_(s)
        gdn.note_step()
        cuda.tree_spec_forward(layer, SimpleNamespace(**vars(md)), x, b, a, *layer.kv_cache)
        gdn.commit(rows, num, n)
        torch.cuda.synchronize()
        after.append([c.clone() for c in layer.kv_cache])
    assert list(gdn._graphs) == [n]
    for eager, replay, s in zip(*after, start):
        assert torch.equal(eager, replay) and not torch.equal(eager, s)
