"""CudaDDTreeRuntime (payload/cuda_runtime.py) through one verify step with a fake runner:
tree positions, the static tree inputs of the attention, the walk through the sampler,
then commit (positions back, path rows first, KV moved in the paged FA-layout cache).
Runs on CPU (torch paths of the core) and on CUDA."""

import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from .conftest import HAS_CUDA, INTERPRET, payload_module, spec_config


def _runtime_module(monkeypatch):
    """payload/cuda_runtime.py; without vLLM, vllm.v1.outputs is stubbed for the test."""
    try:
        import vllm.v1.outputs  # noqa: F401
    except Exception:
        @dataclass
        class SamplerOutput:  # the two fields vLLM's SamplerOutput has
            sampled_token_ids: torch.Tensor
            logprobs_tensors: object = None

        for k in ("vllm", "vllm.v1", "vllm.v1.outputs"):
            monkeypatch.setitem(sys.modules, k, types.ModuleType(k))
        sys.modules["vllm.v1.outputs"].SamplerOutput = SamplerOutput
    payload_module("v1.sampler")
    return payload_module("v1.cuda")


def _impl(name: str, head_size: int = 2):
    """An attention impl as the runtime sees it: its class name and head size."""
    return type(name, (), {"head_size": head_size})()


def _kv_cache(layout: str, dev, bs: int):
    """16 blocks, 1 KV head, head size 2; every slot's K/V distinct."""
    if layout == "kv_outer":  # 0.20.x FA/Flex: [2, blocks, block_size, heads, D]
        kv = torch.zeros(2, 16, bs, 1, 2, device=dev)
        kv[..., 0] = torch.arange(16 * bs, device=dev, dtype=torch.float32).view(1, 16, bs, 1)
        kv[1] += 1000
        return kv, lambda c: c.view(2, -1, 1, 2).transpose(0, 1)  # [slots, 2, 1, 2]
    # heads_packed (0.32/0.33 FA/Triton): [blocks, heads, block_size, 2 * D]
    kv = torch.zeros(16, 1, bs, 4, device=dev)
    kv[..., 0] = torch.arange(16 * bs, device=dev, dtype=torch.float32).view(16, 1, bs)
    kv[..., 2] = kv[..., 0] + 1000
    return kv, lambda c: c.permute(0, 2, 1, 3).reshape(-1, 1, 4)  # [slots, 1, 4]


@pytest.mark.parametrize("layout", ["kv_outer", "heads_packed"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_one_verify_step(dev, fused, layout, monkeypatch):
    """fused: the Triton bookkeeping of core/step.py (CUDA, or the CPU interpreter);
    otherwise its torch reference there.  Same assertions for both, for
    the KV layouts of 0.20.x and of 0.32/0.33."""
    if fused and dev == "cpu" and not INTERPRET:
        pytest.skip("the fused kernels on the CPU need TRITON_INTERPRET=1")
    cr = _runtime_module(monkeypatch)
    core = payload_module("core")
    B, L, V, H, BS = 6, 3, 16, 4, 4
    g = torch.Generator().manual_seed(3)
    # trees of the proposer's last call: rows ["x", "a"]
    draft = torch.randn(2, L, V, generator=g) * 2
    tree = core.build_tree(draft.to(dev), B, B)
    # batch: a (tree, 6 drafts), b (no stored tree: chain, 3 drafts), c (no drafts)
    ctx = {"a": 10, "b": 5, "c": 0}
    qlen = {"a": 7, "b": 4, "c": 3}
    reqs = ["a", "b", "c"]
    qsl = np.array([0, 7, 11, 14, 14, 14], dtype=np.int32)
    t = 14
    lin = torch.cat([torch.arange(ctx[r], ctx[r] + qlen[r]) for r in reqs]).to(dev)
    positions = torch.zeros(32, dtype=torch.int64, device=dev)
    positions[:t] = lin
    nblocks = 5
    bt = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]],
                      dtype=torch.int32, device=dev)
    kv, slots_of = _kv_cache(layout, dev, BS)
    impl = "FlashAttentionImpl" if layout == "kv_outer" else "TritonAttentionImpl"
    runner = SimpleNamespace(
        device=torch.device(dev), max_num_reqs=4, sampler=None,
        speculative_config=spec_config(B, L),
        positions=positions,
        input_ids=SimpleNamespace(gpu=torch.arange(100, 132, device=dev)),
        query_start_loc=SimpleNamespace(np=qsl),
        # KV-cache group 0 is the drafter's (a wrong table here), group 1 the target's
        input_batch=SimpleNamespace(req_ids=reqs, block_table=[
            SimpleNamespace(get_device_tensor=lambda n: (bt[:n] + 1) % 15),
            SimpleNamespace(get_device_tensor=lambda n: bt[:n])]),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[
            SimpleNamespace(layer_names=["drafter.layers.0.attn"]),
            SimpleNamespace(layer_names=["model.layers.0.attn"])]),
        requests={r: None for r in reqs},
        compilation_config=SimpleNamespace(static_forward_context={
            "model.layers.0.attn": SimpleNamespace(impl=_impl(impl), kv_cache=kv),
            "drafter.layers.0.attn": SimpleNamespace(impl=_impl("FlashAttentionImpl"),
                                                     kv_cache=kv.clone())}),
        drafter=SimpleNamespace(_draft_attn_layer_names={"drafter.layers.0.attn"}),
    )
    rt = cr.make_runtime(runner)
    assert isinstance(rt, cr.CudaDDTreeRuntime) == (dev == "cuda")
    if dev == "cpu":  # exercise the CUDA runtime's logic on the CPU too
        rt = cr.CudaDDTreeRuntime(runner)
    rt.fused = fused
    rt.store_trees(["x", "a"], tree)
    a_tok = tree.tokens[1].tolist()
    b_tok = [3, 4, 5]
    sched = SimpleNamespace(scheduled_spec_decode_tokens={"a": a_tok, "b": b_tok})
    rt.prepare(sched, t)
    dep = tree.depths[1].cpu()
    assert positions[1:7].cpu().tolist() == (10 + dep).tolist()  # a: root pos + depth
    assert torch.equal(positions[7:14], lin[7:14])  # b (chain) and c stay linear
    assert rt.state.has_tree.cpu().tolist() == [1, 0, 0, 0]
    assert torch.equal(rt.state.mask[0].bool(), tree.ancestor_mask[1])
    md = SimpleNamespace(causal=True)
    drafter_md = SimpleNamespace(causal=False)
    rt.attach({"l0": md, "l1": md, "d0": drafter_md})
    assert md.ddtree is rt.state and not hasattr(drafter_md, "ddtree")

    # target: for a follow the deepest path of the tree; b accepts 2 then stops
    par = tree.parents[1].cpu().tolist()
    leaf = len(par) - 1  # the last node popped: its path is off the first chain
    path = [leaf]
    while par[path[-1]] >= 0:
        path.append(par[path[-1]])
    path = path[::-1]  # node indices root -> leaf
    assert any(p != k for k, p in enumerate(path))  # some rows must move
    logits = torch.zeros(12, V, device=dev)
    rows_a = [0] + [p + 1 for p in path]  # verify rows along the path
    for k, r in enumerate(rows_a[:-1]):
        logits[r, a_tok[path[k]]] = 10
    logits[rows_a[-1], 7] = 10  # bonus after the leaf
    logits[7 + 0, 3] = 10
    logits[7 + 1, 4] = 10
    logits[7 + 2, 9] = 10  # mismatch with 5: bonus 9
    logits[11, 2] = 10  # c: its next token
    meta = SimpleNamespace(num_draft_tokens=[6, 3, 0])
    out = rt.sampler(meta, None, logits, SimpleNamespace(all_greedy=True))
    toks = out.sampled_token_ids.cpu()
    assert toks[0, : len(path) + 1].tolist() == [a_tok[p] for p in path] + [7]
    assert toks[1, :3].tolist() == [3, 4, 9] and toks[1, 3:].eq(-1).all()
    assert toks[2, 0] == 2 and toks[2, 1:].eq(-1).all()

    base = torch.arange(32, device=dev, dtype=torch.float32).unsqueeze(1)
    # aux hidden states: several of one kind (one launch) and one of another width
    aux = [base.repeat(1, H) + 100 * k for k in range(3)] + [base.repeat(1, 2 * H) + 300]
    kv_before = kv.clone()
    drafter_before = runner.compilation_config.static_forward_context[
        "drafter.layers.0.attn"].kv_cache.clone()
    rt.commit(aux)
    assert torch.equal(positions[:t], lin)  # linear again
    acc = len(path)
    want = list(range(32))
    for j in range(1, acc + 1):
        want[j] = rows_a[j]  # a's root is row 0
    for k, h in enumerate(aux):
        assert (h - 100 * k).long().cpu().tolist() == [[w] * h.shape[1] for w in want]
    ids = runner.input_ids.gpu.cpu().tolist()
    assert ids[: acc + 1] == [100 + r for r in rows_a]
    # KV: position 10 + j of a now holds what position 10 + rows_a[j] held
    def slot(r, pos):
        return int(bt[r, pos // BS]) * BS + pos % BS
    flat, flat_before = slots_of(kv), slots_of(kv_before)
    for j in range(1, acc + 1):
        assert torch.equal(flat[slot(0, 10 + j)], flat_before[slot(0, 10 + rows_a[j])])
    moved = {slot(0, 10 + j) for j in range(1, acc + 1) if rows_a[j] != j}
    for s in range(flat.shape[0]):
        if s not in moved:
            assert torch.equal(flat[s], flat_before[s])
    assert torch.equal(runner.compilation_config.static_forward_context[
        "drafter.layers.0.attn"].kv_cache, drafter_before)  # drafter layers untouched
    assert rt.step is None

    # a step without drafts clears the static tree flags
    rt.prepare(SimpleNamespace(scheduled_spec_decode_tokens={}), t)
    assert rt.state.has_tree.sum() == 0 and rt.step is None

    # drafts but no stored tree: every request is verified as a chain
    rt.prepare(SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2], "b": [3]}), t)
    assert rt.state.has_tree.sum() == 0
    assert rt.step.tree.parents.cpu().tolist() == [[-1, 0], [-1, 0], [-1, 0]]
    assert rt.step.tree.num_nodes.cpu().tolist() == [2, 1, 0]
    assert torch.equal(positions[:t], lin)
    rt.commit(aux)
    assert torch.equal(positions[:t], lin) and rt.step is None


def test_unhooked_backend_is_refused_before_any_verify(monkeypatch):
    """A target layer whose attention forward has no tree hook (e.g. FlashInfer) would
    ignore the tree mask: the first prepare with drafts refuses it."""
    cr = _runtime_module(monkeypatch)
    kv, _ = _kv_cache("heads_packed", "cpu", 4)
    runner = SimpleNamespace(
        device=torch.device("cpu"), max_num_reqs=2, sampler=None,
        speculative_config=spec_config(4, 2),
        positions=torch.zeros(8, dtype=torch.int64),
        input_ids=SimpleNamespace(gpu=torch.zeros(8, dtype=torch.int64)),
        query_start_loc=SimpleNamespace(np=np.array([0, 3, 3], dtype=np.int32)),
        input_batch=SimpleNamespace(req_ids=["a"], block_table=[]),
        requests={"a": None},
        compilation_config=SimpleNamespace(static_forward_context={
            "model.layers.0.attn": SimpleNamespace(impl=_impl("FlashInferImpl"), kv_cache=kv)}),
        drafter=SimpleNamespace(_draft_attn_layer_names=set()))
    rt = cr.CudaDDTreeRuntime(runner)
    with pytest.raises(NotImplementedError, match="FlashInferImpl"):
        rt.prepare(SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2]}), 3)
    assert int(runner.positions.abs().sum()) == 0  # nothing was written


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_commit_restores_every_row_of_a_tree_wider_than_its_depth(dev, fused):
    """#31: V1's DFlash stores context K/V for every verified row at its position, the
    rejected ones too.  A tree of B = 40 nodes at depth <= 3 has rows whose tree
    positions (root + depth) would overwrite the accepted tokens' drafter KV; commit
    must put all 40 rows back on their linear positions, not just the first 16."""
    if fused and dev == "cpu" and not INTERPRET:
        pytest.skip("the fused kernels on the CPU need TRITON_INTERPRET=1")
    step = payload_module("core.step")
    B, W, n = 40, 3, 2
    t = n * (1 + B)
    lin = torch.arange(100, 100 + t, dtype=torch.int64)
    positions = lin.clone()
    for r in range(n):  # the verify's tree positions: root + depth (1..3) per node
        root = r * (1 + B)
        positions[root + 1: root + 1 + B] = lin[root] + 1 + torch.arange(B) % W
    positions = positions.to(dev)
    # pack: [drafts | stored-tree index | root row]; request 1 accepted rows 5 and 17
    pack = torch.tensor([B, B, 0, 1, 0, 1 + B], dtype=torch.int64, device=dev)
    rows = torch.tensor([[0, -1, -1, -1], [0, 5, 17, -1]], dtype=torch.int64, device=dev)
    nacc = torch.tensor([0, 2], dtype=torch.int64, device=dev)
    ids = torch.arange(t, dtype=torch.int64, device=dev) + 1000
    src, dst = (torch.full((n, W), -7, dtype=torch.int64, device=dev) for _ in range(2))
    start, neff = (torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(2))
    step.commit(pack, n, rows, nacc, positions, ids, src, dst, start, neff, fused, B)
    assert torch.equal(positions.cpu(), lin), "every tree row back on its linear position"
    assert start.cpu().tolist() == [100, 141] and neff.cpu().tolist() == [0, 2]
    assert dst.cpu().tolist() == [[-1, -1, -1], [42, 43, -1]]
    assert src.cpu().tolist() == [[-1, -1, -1], [46, 58, -1]]
    assert ids[42].item() == 1046 and ids[43].item() == 1058
