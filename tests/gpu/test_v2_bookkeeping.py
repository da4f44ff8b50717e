"""DDTree on vLLM's V2 runner: the per-step bookkeeping (payload/v2_step.py) and one
verify step through V2DDTree + DDTreeV2Sampler with a fake V2 runner (positions, tree
masks, the walk and its num_sampled / num_rejected, commit: positions back, path rows
first, KV compaction in the [blocks, kv_heads, block_size, 2 * head] cache).

Runs on CPU (torch references), on CPU through the Triton interpreter
(TRITON_INTERPRET=1: the fused kernels, compared with the references) and on CUDA.
The three vLLM helpers the sampler imports are stubbed here with torch versions of
their V2 semantics when vLLM is not importable (the dev env has no vLLM); the real
ones run in tests/engine/test_v2_helpers.py."""

import json
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from .conftest import HAS_CUDA, INTERPRET, payload_module, spec_config

DEVS = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def _fused_ok(dev, fused):
    if fused and dev == "cpu" and not INTERPRET:
        pytest.skip("the fused kernels on the CPU need TRITON_INTERPRET=1")


# ------------------------------------------------------------------ vLLM stubs


def _num_sampled_and_rejected(num_sampled, seq_lens, cu_num_logits, idx_mapping,
                              prefill_len):
    """torch version of V2's get_num_sampled_and_rejected (input_batch.py)."""
    n = idx_mapping.shape[0]
    chunked = seq_lens[:n] < prefill_len[idx_mapping].to(seq_lens.dtype)
    num_sampled = torch.where(chunked, torch.zeros_like(num_sampled), num_sampled)
    nl = (cu_num_logits[1: n + 1] - cu_num_logits[:n]).to(num_sampled.dtype)
    return num_sampled, torch.where(chunked, torch.zeros_like(nl), nl - num_sampled)


@dataclass
class _SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs_tensors: object
    num_nans: object
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor


def _modules(monkeypatch, dev="cpu"):
    try:
        import vllm.v1.worker.gpu.input_batch  # noqa: F401
    except Exception:
        stubs = {"vllm.v1.worker.gpu.input_batch": {
                     "get_num_sampled_and_rejected": _num_sampled_and_rejected},
                 "vllm.v1.worker.gpu.metrics.logits": {
                     "get_num_nans": lambda x: torch.isnan(x).sum(-1)},
                 "vllm.v1.worker.gpu.sample.output": {"SamplerOutput": _SamplerOutput}}
        for name in ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu",
                     "vllm.v1.worker.gpu.metrics", "vllm.v1.worker.gpu.sample",
                     *stubs):
            mod = types.ModuleType(name)
            for k, v in stubs.get(name, {}).items():
                setattr(mod, k, v)
            monkeypatch.setitem(sys.modules, name, mod)
    sampler = payload_module("v2.sampler")
    if dev == "cpu":  # vLLM's own helper is a CUDA Triton kernel where vLLM is installed
        monkeypatch.setattr(sampler, "get_num_sampled_and_rejected",
                            _num_sampled_and_rejected)
    return payload_module("v2.runtime"), payload_module("v2.step"), payload_module("core")


# ------------------------------------------------------------------ a fake V2 batch


B, L, V, BS, HD = 6, 3, 16, 4, 2  # budget, depth, vocab, block size, head size


class Batch(SimpleNamespace):
    """Four requests in batch order: 0 = a verify step with a stored tree (slot 2, root
    at position 10, 6 drafts); 1 = a prefill chunk (slot 0, positions 0-2 of an 8-token
    prompt); 2 = drafts that are placeholders (slot 3: its root, position 4, is inside
    the 6-token prompt); 3 = a decode without drafts (slot 1, position 7)."""


def make_batch(dev):
    qlen = [7, 3, 3, 1]
    start = [10, 0, 4, 7]
    nlog = [7, 1, 3, 1]
    qsl = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(nlog)]).astype(np.int32)
    lin = torch.cat([torch.arange(s, s + q) for s, q in zip(start, qlen)])
    positions = torch.zeros(20, dtype=torch.int64)
    positions[:14] = lin
    li = torch.cat([torch.arange(q1 - n, q1) for q1, n in zip(qsl[1:], nlog)])
    idx_np = np.array([2, 0, 3, 1])
    return Batch(num_reqs=4, num_draft_tokens=8, idx_mapping_np=idx_np,
                 idx_mapping=torch.tensor(idx_np, device=dev),
                 cu_num_logits=torch.tensor(cu, device=dev), cu_num_logits_np=cu,
                 query_start_loc=torch.tensor(qsl, device=dev),
                 positions=positions.to(dev), linear=lin.to(dev),
                 input_ids=torch.arange(100, 120, device=dev),
                 logits_indices=li.to(dev),
                 seq_lens=torch.tensor([17, 3, 7, 8], dtype=torch.int32, device=dev))


def make_runner(dev, core, v2_step, temperature=0.0):
    g = torch.Generator().manual_seed(3)
    trees = v2_step.SlotTrees(4, B, dev)
    tree = core.build_tree((torch.randn(2, L, V, generator=g) * 2).to(dev), B, B)
    trees.store(torch.tensor([2, 3], device=dev), tree)
    draft_tokens = torch.zeros(4, B, dtype=torch.int64, device=dev)
    draft_tokens[[2, 3]] = tree.tokens
    nblocks = 20
    kv = torch.randn(nblocks, 1, BS, 2 * HD, generator=g).to(dev)
    ctx = {"model.layers.0.self_attn.attn": SimpleNamespace(kv_cache=kv),
           "model.layers.1.self_attn.attn": SimpleNamespace(kv_cache=kv),  # shared
           "drafter.layers.0.attn": SimpleNamespace(kv_cache=kv.clone())}
    bt = torch.arange(nblocks, dtype=torch.int32, device=dev).view(4, 5).flip(0)
    seeds = torch.tensor([11, -5, 7, 2**40], dtype=torch.int64, device=dev)
    st = SimpleNamespace(temperature=SimpleNamespace(
                             np=np.full(4, temperature, dtype=np.float32),
                             gpu=torch.full((4,), temperature, device=dev)),
                         top_k=SimpleNamespace(np=np.full(4, V), gpu=None),
                         top_p=SimpleNamespace(np=np.ones(4), gpu=None),
                         seeds=SimpleNamespace(gpu=seeds), vocab_size=V,
                         max_num_logprobs=lambda slots: -1,  # V2's NO_LOGPROBS
                         min_p=SimpleNamespace(np=np.zeros(4)))
    req_states = SimpleNamespace(prefill_len=SimpleNamespace(
        gpu=torch.tensor([8, 3, 5, 6], dtype=torch.int32, device=dev)),
        draft_tokens=draft_tokens)
    runner = SimpleNamespace(
        device=torch.device(dev), max_num_reqs=4, req_states=req_states,
        speculative_config=spec_config(B, L),
        speculator=SimpleNamespace(num_speculative_steps=L, trees=trees, expect=None,
                                   draft_attn_layer_names={"drafter.layers.0.attn"}),
        model_state=SimpleNamespace(),
        # no logits processor, no min_p (v2/requests.py: test_v2_requests.py)
        sampler=SimpleNamespace(sampling_states=st, compute_nans=False,
                                req_states=req_states, logits_processors=[]),
        block_tables=SimpleNamespace(input_block_tables=[bt], block_sizes=[BS]),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            layer_names=list(ctx))]),
        compilation_config=SimpleNamespace(static_forward_context=ctx),
        kv_caches=[kv, ctx["drafter.layers.0.attn"].kv_cache],
        attn_groups=[[SimpleNamespace(layer_names=list(ctx),
                                      backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))]],
    )
    return runner, tree


def deepest_path(tree, r):
    par = tree.parents[r].cpu().tolist()
    path = [int(tree.depths[r].argmax())]
    while par[path[-1]] >= 0:
        path.append(par[path[-1]])
    return path[::-1]


# ------------------------------------------------------------------ one verify step


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dev", DEVS)
def test_one_verify_step(dev, fused, monkeypatch):
    _fused_ok(dev, fused)
    v2r, v2_step, core = _modules(monkeypatch, dev)
    runner, tree = make_runner(dev, core, v2_step)
    rt = v2r.V2DDTree(runner)
    rt.fused = fused
    assert runner.speculator.runtime is rt and runner.model_state.ddtree is rt
    batch = make_batch(dev)
    tok = tree.tokens[0].tolist()
    batch.input_ids[1:7] = tree.tokens[0]

    rt.prepare(batch)
    pos = batch.positions
    assert pos[1:7].tolist() == (10 + tree.depths[0]).tolist()  # root position + depth
    assert torch.equal(pos[7:14], batch.linear[7:14])  # no tree: linear
    assert torch.equal(pos[0:1], batch.linear[0:1])
    assert rt.state.has_tree.tolist() == [1, 0, 0, 0]
    assert torch.equal(rt.state.mask[0].bool(), tree.ancestor_mask[0])
    step = rt.step
    assert step.tree.num_nodes.tolist() == [6, 0, 0, 0]  # the placeholder row: no tree
    assert torch.equal(step.tree.parents[0], tree.parents[0])
    assert step.tree.parents[1].tolist() == list(range(-1, B - 1))
    assert step.pack[8:12].tolist() == [0, -1, -1, -1]  # token row of the root

    md, shared, drafter_md = (SimpleNamespace(causal=True), SimpleNamespace(causal=True),
                              SimpleNamespace(causal=False))
    rt.mark(batch, {"model.layers.0.self_attn.attn": md,
                    "model.layers.1.self_attn.attn": md,
                    "drafter.layers.0.attn": drafter_md}, for_capture=False)
    assert md.ddtree is rt.state and not hasattr(drafter_md, "ddtree")
    rt.mark(make_batch(dev), {"model.layers.0.self_attn.attn": shared}, for_capture=False)
    assert not hasattr(shared, "ddtree")  # another batch: not this step's

    # target: request 0 follows the tree's deepest path, then bonus 7
    path = deepest_path(tree, 0)
    logits = torch.zeros(12, V, device=dev)
    rows0 = [0] + [p + 1 for p in path]
    for k, r in enumerate(rows0[:-1]):
        logits[r, tok[path[k]]] = 10
    logits[rows0[-1], 7] = 10
    logits[7, 2] = 10  # the prefill chunk's row (no token: still prefilling)
    logits[8, 5] = 10  # the placeholder request samples at its first row
    logits[9, tree.tokens[1, 0]] = 10  # ...whatever its placeholder drafts say
    logits[11, 9] = 10
    out = rt.sampler(logits, batch)
    a = len(path)
    toks = out.sampled_token_ids.cpu()
    assert toks.shape == (4, B + 1)
    assert toks[0, : a + 1].tolist() == [tok[p] for p in path] + [7]
    assert toks[0, a + 1:].eq(-1).all()
    assert toks[2, 0] == 5 and toks[2, 1:].eq(-1).all()
    assert toks[3, 0] == 9
    assert out.num_sampled.tolist() == [a + 1, 0, 1, 1]
    assert out.num_rejected.tolist() == [6 - a, 0, 2, 0]

    ctx = runner.compilation_config.static_forward_context
    kv = ctx["model.layers.0.self_attn.attn"].kv_cache
    kv_before, drafter_before = kv.clone(), ctx["drafter.layers.0.attn"].kv_cache.clone()
    base = torch.arange(20, device=dev, dtype=torch.float32).unsqueeze(1)
    aux = [base.repeat(1, 4) + 100 * k for k in range(3)]
    tree_pos = batch.positions.clone()
    rt.commit(batch, None, aux)
    # rows within the walk's depth (at least) linear again: the drafter reads the
    # path's; deeper ones (never accepted) may keep their tree positions
    assert torch.equal(batch.positions[: L + 1], batch.linear[: L + 1])
    rest = batch.positions[L + 1: 7]
    assert bool(((rest == tree_pos[L + 1: 7]) | (rest == batch.linear[L + 1: 7])).all())
    assert torch.equal(batch.positions[7:14], batch.linear[7:])
    want = list(range(20))
    for j in range(1, a + 1):
        want[j] = rows0[j]  # request 0's root is token row 0
    for k, h in enumerate(aux):
        assert (h - 100 * k)[:, 0].long().tolist() == want
    assert batch.input_ids[: a + 1].tolist() == [100 + r for r in rows0[:1]] + \
        [tok[p] for p in path]
    # KV of position 10 + j now holds what position 10 + rows0[j] held (request 0's
    # block table row 0); every other slot unchanged; drafter layers untouched
    bt = runner.block_tables.input_block_tables[0]

    def slot(p):
        return int(bt[0, p // BS]), p % BS

    moved = set()
    for j in range(1, a + 1):
        d, s = slot(10 + j), slot(10 + rows0[j])
        assert torch.equal(kv[d[0], :, d[1]], kv_before[s[0], :, s[1]])
        moved.add(d)
    for b in range(kv.shape[0]):
        for o in range(BS):
            if (b, o) not in moved:
                assert torch.equal(kv[b, :, o], kv_before[b, :, o])
    assert torch.equal(ctx["drafter.layers.0.attn"].kv_cache, drafter_before)
    assert rt.step is None and rt.walk is None

    # a step without drafts clears the tree flags; FULL-graph captures mark everything
    rt.prepare(SimpleNamespace(num_draft_tokens=0))
    assert rt.state.has_tree.sum() == 0 and rt.step is None
    cap = SimpleNamespace(causal=True)
    rt.mark(None, {"model.layers.0.self_attn.attn": cap}, for_capture=True)
    assert cap.ddtree is rt.state


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dev", DEVS)
def test_chain_step(dev, fused, monkeypatch, tmp_path):
    """ddtree_chain_budget >= the step's drafts per request: the drafts are verified as
    a chain (linear positions, no tree rows, no tree mark, a chain walk) and the commit
    moves nothing (rows, input ids, KV stay); budget < the drafts: the tree step."""
    _fused_ok(dev, fused)
    v2r, v2_step, core = _modules(monkeypatch, dev)
    runner, tree = make_runner(dev, core, v2_step)
    runner.speculator.chain_budget = 5
    stats = tmp_path / "stats.json"
    monkeypatch.setenv("VLLM_DDTREE_STATS_FILE", str(stats))
    rt = v2r.V2DDTree(runner)
    rt.fused = fused
    rt.prepare(make_batch(dev))
    assert not rt.step.chain  # 6 drafts > 5: the tree step
    rt.chain_budget = 6
    batch = make_batch(dev)
    tok = tree.tokens[0].tolist()
    batch.input_ids[1:7] = tree.tokens[0]
    ids_before = batch.input_ids.clone()
    rt.state.has_tree.fill_(1)  # left over from an earlier tree step
    rt.prepare(batch)
    step = rt.step
    assert step.chain
    assert torch.equal(batch.positions[:14], batch.linear)
    assert rt.state.has_tree.tolist() == [0, 0, 0, 0]
    assert step.tree.num_nodes.tolist() == [6, 0, 0, 0]  # all 6 drafts, as a chain
    assert step.pack[4:].tolist() == [-1] * 8
    for r in range(4):
        assert step.tree.parents[r].tolist() == list(range(-1, B - 1))
    md = SimpleNamespace(causal=True)
    rt.mark(batch, {"model.layers.0.self_attn.attn": md}, for_capture=False)
    assert not hasattr(md, "ddtree")  # the backend's own causal kernel

    logits = torch.zeros(12, V, device=dev)
    logits[0, tok[0]] = 10  # the chain: drafts 0 and 1 accepted, then bonus 7
    logits[1, tok[1]] = 10
    logits[2, 7] = 10
    logits[7, 2] = 10
    logits[8, 5] = 10
    logits[11, 9] = 10
    out = rt.sampler(logits, batch)
    toks = out.sampled_token_ids.cpu()
    assert toks[0, :3].tolist() == [tok[0], tok[1], 7] and toks[0, 3:].eq(-1).all()
    assert out.num_sampled.tolist() == [3, 0, 1, 1]
    assert out.num_rejected.tolist() == [4, 0, 2, 0]

    kv = runner.compilation_config.static_forward_context[
        "model.layers.0.self_attn.attn"].kv_cache
    kv_before = kv.clone()
    aux = [torch.arange(20.0, device=dev).unsqueeze(1).repeat(1, 4)]
    aux_before = aux[0].clone()
    rt.commit(batch, None, aux)
    assert torch.equal(kv, kv_before) and torch.equal(aux[0], aux_before)
    assert torch.equal(batch.input_ids, ids_before)
    assert torch.equal(batch.positions[:14], batch.linear)
    assert rt.step is None and rt.walk is None
    # counted apart from trees: one chain step, one row with drafts, 6 drafted, 2 accepted
    got = json.loads(stats.read_text())
    assert (got["chain_steps"], got["chain_rows"], got["chain_drafted"],
            got["chain_accepted"], got["trees"]) == (1, 1, 6, 2, 0)


def _chi2_p(obs: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts obs [V] against probs [V] (cells with an
    expected count < 5 pooled)."""
    exp = probs.double() / probs.sum() * obs.sum()
    big = exp >= 5
    o, e = obs[big].double(), exp[big]
    if not big.all():
        o = torch.cat([o, obs[~big].double().sum().reshape(1)])
        e = torch.cat([e, exp[~big].sum().reshape(1)])
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2, dtype=torch.float64),
                                         stat / 2))


@pytest.mark.parametrize("dev", DEVS)
def test_chain_step_sampling_keeps_the_target_distribution(dev, monkeypatch):
    """T = 1, a chain step: over many seeds the first emitted token follows the root
    row's target distribution, and after an accepted first draft the second token
    follows row 1's (chi-square); the same counts against a distribution with the draft
    favoured fail, so the test can fail.  Uniforms from one generator (any independent
    U(0, 1) draws; the seeded ones are tested above and their CPU reference is slow)."""
    v2r, v2_step, core = _modules(monkeypatch, dev)
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(v2_step, "uniforms", lambda seeds, pos, width, fused: torch.rand(
        seeds.shape[0], width, generator=g).to(seeds.device))
    runner, tree = make_runner(dev, core, v2_step, temperature=1.0)
    runner.speculator.chain_budget = 6
    rt = v2r.V2DDTree(runner)
    rt.fused = v2_step.use_fused(dev)
    d0, d1 = tree.tokens[0, 0].item(), tree.tokens[0, 1].item()
    logits = torch.zeros(12, V)
    logits[0] = torch.linspace(-1.0, 1.0, V)
    logits[0, d0] = 1.2  # the first draft: the likeliest token, far from certain
    logits[1] = torch.linspace(1.0, -1.0, V)
    logits[1, d1] = 1.5
    logits = logits.to(dev)
    p0, p1 = logits[0].softmax(-1).cpu(), logits[1].softmax(-1).cpu()
    first, second = torch.zeros(V), torch.zeros(V)
    batch = make_batch(dev)
    for _ in range(1500):
        rt.prepare(batch)
        assert rt.step.chain
        out = rt.sampler(logits, batch)
        t = out.sampled_token_ids[0].tolist()
        first[t[0]] += 1
        if t[0] == d0:
            second[t[1]] += 1
        rt.step = rt.walk = None
    assert _chi2_p(first, p0) > 1e-3 and _chi2_p(second, p1) > 1e-3
    biased = p0.clone()
    biased[d0] *= 2.0
    assert _chi2_p(first, biased) < 1e-6  # the test has power


def test_chain_graphs_keep_the_backend_kernel(monkeypatch):
    """FULL-graph captures: <= 1 + C query rows per request can only replay chain steps
    (no tree mark); longer or unknown: the tree kernel (which runs chain rows causally)."""
    v2r, v2_step, core = _modules(monkeypatch)
    runner, _ = make_runner("cpu", core, v2_step)
    runner.speculator.chain_budget = 3
    rt = v2r.V2DDTree(runner)
    for q, marked in ((4, False), (1, False), (5, True), (None, True)):
        md = SimpleNamespace(causal=True)
        rt.mark(SimpleNamespace(max_query_len=q), {"model.layers.0.self_attn.attn": md},
                for_capture=True)
        assert hasattr(md, "ddtree") == marked, q
    rt.chain_budget = 0  # off: every capture holds the tree kernel
    md = SimpleNamespace(causal=True)
    rt.mark(SimpleNamespace(max_query_len=1), {"model.layers.0.self_attn.attn": md}, True)
    assert md.ddtree is rt.state


def test_refusals(monkeypatch):
    v2r, v2_step, core = _modules(monkeypatch)
    runner, _ = make_runner("cpu", core, v2_step)
    runner.attn_groups[0][0].backend = SimpleNamespace(get_name=lambda: "FLASHINFER")
    rt = v2r.V2DDTree(runner)
    batch = make_batch("cpu")
    rt.prepare(batch)
    with pytest.raises(NotImplementedError, match="FLASHINFER"):
        rt.mark(batch, {"model.layers.0.self_attn.attn": SimpleNamespace(causal=True)},
                False)
    runner.attn_groups[0][0].backend = SimpleNamespace(get_name=lambda: "TRITON_ATTN")
    with pytest.raises(NotImplementedError, match="plain causal"):
        rt.mark(batch, {"model.layers.0.self_attn.attn": SimpleNamespace(
            causal=torch.ones(2))}, False)
    with pytest.raises(RuntimeError, match="no prepared tree step"):
        rt.sampler(torch.zeros(12, V), make_batch("cpu"))
    ctx = runner.compilation_config.static_forward_context
    ctx["model.layers.0.self_attn.attn"].kv_cache = torch.zeros(2, 20, BS, 1, HD)
    with pytest.raises(NotImplementedError, match="compacts KV caches"):
        rt._target_kv()
    # a backend without the tree hook is refused at the first step, also when that step
    # is a chain step (which would not need the hook) or a chain-only graph capture
    runner.attn_groups[0][0].backend = SimpleNamespace(get_name=lambda: "FLASHINFER")
    runner.speculator.chain_budget = 6
    for for_capture in (False, True):
        rt = v2r.V2DDTree(runner)
        batch = make_batch("cpu")
        rt.prepare(batch)
        assert rt.step.chain
        with pytest.raises(NotImplementedError, match="FLASHINFER"):
            rt.mark(SimpleNamespace(max_query_len=2) if for_capture else batch,
                    {"model.layers.0.self_attn.attn": SimpleNamespace(causal=True)},
                    for_capture)


@pytest.mark.parametrize("dev", DEVS)
def test_sampled_walk_is_seeded_per_request(dev, monkeypatch):
    """T > 0: the same request with the same seed at the same positions samples the
    same path whatever else is in the batch; another seed samples differently."""
    v2r, v2_step, core = _modules(monkeypatch, dev)
    fused = v2_step.use_fused(dev)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(12, V, generator=g) * 0.7).to(dev)

    def run(seeds):
        runner, tree = make_runner(dev, core, v2_step, temperature=1.0)
        runner.sampler.sampling_states.seeds.gpu.copy_(torch.tensor(seeds, device=dev))
        rt = v2r.V2DDTree(runner)
        rt.fused = fused
        batch = make_batch(dev)
        rt.prepare(batch)
        out = rt.sampler(logits, batch)
        n0 = int(out.num_sampled[0])
        rows = rt.walk.accepted_rows[0, :n0].tolist()
        # the path is a path: each accepted row's parent is the previous one
        par = tree.parents[0].tolist()
        for x, y in zip(rows, rows[1:]):
            assert par[y - 1] == x - 1
        return out.sampled_token_ids[0, :n0].tolist()

    outs = {s: run([3, 5, s, 9]) for s in range(12)}  # slot 2 = request 0
    same = run([4, 6, 0, 1])
    assert same == outs[0]  # other rows' seeds do not matter
    assert len({tuple(v) for v in outs.values()}) > 1  # the seed does


# ------------------------------------------------------------------ kernels vs references


@pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_kernels_match_references():
    """core/step.py's kernels and their torch references (what V1's CUDA runtime and
    V2's both run), on V2's pack; a step without stored trees (tree None) too."""
    v2_step = payload_module("v2.step")
    step_kernels = payload_module("core.step")
    core = payload_module("core")
    dev = "cuda" if HAS_CUDA else "cpu"
    runner, tree = make_runner(dev, core, v2_step)
    trees = runner.speculator.trees
    pl = runner.req_states.prefill_len.gpu
    res = {}
    for fused in (False, True):
        batch = make_batch(dev)
        chain = torch.full((12,), 99, dtype=torch.int64, device=dev)
        v2_step.build_pack(chain, 4, batch.cu_num_logits, batch.query_start_loc,
                           batch.positions, batch.idx_mapping, pl, trees.num_nodes, fused,
                           chain=True)
        assert chain.tolist() == [6, 0, 0, 0] + [-1] * 8
        has0 = torch.ones(4, dtype=torch.int32, device=dev)
        mask0 = torch.full((4, B + 1, B + 1), 7, dtype=torch.int8, device=dev)
        wpar0 = torch.zeros(4, B, dtype=torch.int64, device=dev)
        pos0 = batch.positions.clone()
        step_kernels.prepare(chain, 4, B, None, pos0, has0, mask0, wpar0, fused)
        assert has0.sum() == 0 and mask0.eq(7).all() and torch.equal(pos0, batch.positions)
        assert wpar0.tolist() == [list(range(-1, B - 1))] * 4  # chains
        pack = torch.full((12,), 99, dtype=torch.int64, device=dev)
        v2_step.build_pack(pack, 4, batch.cu_num_logits, batch.query_start_loc,
                           batch.positions, batch.idx_mapping, pl, trees.num_nodes, fused)
        has = torch.ones(4, dtype=torch.int32, device=dev)
        mask = torch.zeros(4, B + 1, B + 1, dtype=torch.int8, device=dev)
        wpar = torch.zeros(4, B, dtype=torch.int64, device=dev)
        step_kernels.prepare(pack, 4, B, trees, batch.positions, has, mask, wpar, fused)
        pos_tree = batch.positions.clone()
        rows = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, -1, -1, -1],
                             [0, -1, -1, -1]], device=dev)
        nacc = torch.tensor([2, 0, 0, 0], device=dev)
        src = torch.zeros(4, 3, dtype=torch.int64, device=dev)
        dst, start, neff = src.clone(), src[:, 0].clone(), src[:, 0].clone()
        step_kernels.commit(pack, 4, rows, nacc, batch.positions, batch.input_ids, src, dst,
                            start, neff, fused, B)
        h = torch.arange(20.0, device=dev).unsqueeze(1).repeat(1, 3)
        step_kernels.move_rows([h], src, dst, fused)
        res[fused] = [pack, has, mask, wpar, pos_tree, batch.positions, batch.input_ids,
                      src, dst, start, neff, h]
    for x, y in zip(res[False], res[True]):
        assert torch.equal(x, y)
    pack = res[True][0]
    assert pack.tolist() == [6, 0, 0, 0, 2, -1, -1, -1, 0, -1, -1, -1]
    assert res[True][7][0].tolist() == [2, 5, -1] and res[True][8][0].tolist() == [1, 2, -1]
    assert res[True][9][0] == 10 and res[True][10].tolist() == [2, 0, 0, 0]


def test_pack_rows_and_outputs():
    v2_step = payload_module("v2.step")
    core = payload_module("core")
    runner, tree = make_runner("cpu", core, v2_step)
    trees = runner.speculator.trees
    assert trees.parents[0].tolist() == list(range(-1, B - 1))  # fresh slots: chains
    assert torch.equal(trees.ancestor_mask[1],
                       core.ancestor_mask(trees.parents[1:2], B, "torch")[0])
    assert torch.equal(trees.ancestor_mask[2], tree.ancestor_mask[0])
    batch = make_batch("cpu")
    trees.num_nodes[2] = 4  # a stored tree smaller than the scheduled drafts
    pack = torch.zeros(12, dtype=torch.int64)
    v2_step.build_pack(pack, 4, batch.cu_num_logits, batch.query_start_loc, batch.positions,
                       batch.idx_mapping, runner.req_states.prefill_len.gpu, trees.num_nodes,
                       False)
    assert pack.tolist() == [4, 0, 0, 0, 2, -1, -1, -1, 0, -1, -1, -1]
    rows = v2_step.verify_rows(batch.cu_num_logits, 4, B)
    assert rows.tolist() == [[0, 1, 2, 3, 4, 5, 6], [7] * 7, [8, 9, 10, 10, 10, 10, 10],
                             [11] * 7]
    walk = core.WalkResult(accepted_rows=torch.tensor([[0, 1, 3, -1]]),
                           output_tokens=torch.tensor([[5, 6, 7, -1]]),
                           num_accepted=torch.tensor([2]))
    sampled, ns = v2_step.sampler_outputs(walk, 3)
    assert sampled.tolist() == [[5, 6, 7]] and ns.tolist() == [3] and ns.dtype == torch.int32
    sampled, _ = v2_step.sampler_outputs(walk, 6)
    assert sampled.tolist() == [[5, 6, 7, -1, -1, -1]]


@pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
def test_uniforms_kernel():
    v2_step = payload_module("v2.step")
    dev = "cuda" if HAS_CUDA else "cpu"
    seeds = torch.tensor([1, 1, 2, -(2**62)], device=dev)
    pos = torch.tensor([5, 6, 5, 5], device=dev)
    u = v2_step.uniforms(seeds, pos, 4, True)
    assert u.shape == (4, 4) and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u[0, 1:], u[1, :3])  # a function of (seed, position) only
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[3])
    assert torch.equal(u, v2_step.uniforms(seeds, pos, 4, True))
    big = v2_step.uniforms(torch.arange(64, device=dev), torch.zeros(64, device=dev,
                                                                      dtype=torch.int64),
                           32, True).flatten()
    assert abs(float(big.mean()) - 0.5) < 0.02 and abs(float(big.var()) - 1 / 12) < 0.01


def test_uniforms_reference():
    v2_step = payload_module("v2.step")
    seeds = torch.tensor([1, 1, 2])
    pos = torch.tensor([5, 6, 5])
    u = v2_step.uniforms(seeds, pos, 3, False)
    assert torch.equal(u[0, 1:], u[1, :2]) and not torch.equal(u[0], u[2])
    assert bool(((u >= 0) & (u < 1)).all())
