"""CUDA tree attention (payload/cuda_attention.py) against its torch oracle: random
trees (the DDTree builder's ancestor masks), causal rows, mixed batches, GQA, the FA
cache layout through a block table, bf16/fp16/fp32, and replay inside a CUDA graph
with new trees in the static buffers."""

import pytest
import torch

from ddtree_patcher.patches.ddtree.reference.tree_attention import reference_tree_attention

from .conftest import HAS_CUDA, device, payload_module

TOL = {torch.bfloat16: 8e-3, torch.float16: 4e-3, torch.float32: 2e-5}


def random_parents(n_nodes: int, gen, deep: bool = False) -> torch.Tensor:
    """Parents in pop order (parent index < node index, -1 = child of the root); deep:
    each node hangs off one of the two nodes before it (depths near the node count)."""
    par = torch.empty(n_nodes, dtype=torch.int64)
    for i in range(n_nodes):
        lo = max(-1, i - 2) if deep else -1
        par[i] = torch.randint(lo, i, (1,), generator=gen).item() if i else -1
    return par


def make_case(dev, dtype, q_lens, ctx_lens, trees, hq=8, hkv=2, d=64, bs=16, budget=None,
              seed=0, deep=False):
    gen = torch.Generator().manual_seed(seed)
    core = payload_module("core")
    n = len(q_lens)
    budget = budget or max(q_lens) - 1
    rows = budget + 1
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [(s + bs - 1) // bs for s in seq]
    total_blocks = sum(nblk) + 3
    perm = torch.randperm(total_blocks, generator=gen)
    bt = torch.zeros(n, max(nblk), dtype=torch.int32)
    k = 0
    for r in range(n):
        bt[r, : nblk[r]] = perm[k: k + nblk[r]].to(torch.int32)
        k += nblk[r]
    # FA layout [2, blocks, bs, Hkv, D] with a non-trivial stride order (HND-like)
    kv = torch.randn(2, total_blocks, hkv, bs, d, generator=gen).to(dtype).permute(0, 1, 3, 2, 4)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    t = int(qsl[-1])
    query = torch.randn(t, hq, d, generator=gen).to(dtype)
    has = torch.zeros(n + 2, dtype=torch.int32)  # longer than the batch, like the runtime's
    mask = torch.zeros(n + 2, rows, rows, dtype=torch.int8)
    for r, tree in enumerate(trees):
        if tree:
            par = random_parents(q_lens[r] - 1, gen, deep and r % 2 == 0)
            full = torch.full((1, budget), -1, dtype=torch.int64)
            full[0, : len(par)] = par
            am = core.ancestor_mask(full, max(budget, 1), backend="torch")[0]
            mask[r] = am.to(torch.int8)
            has[r] = 1
    put = lambda x: x.to(dev)  # noqa: E731
    return dict(query=put(query), key_cache=put(kv[0]), value_cache=put(kv[1]),
                block_table=put(bt), seq_lens=put(torch.tensor(seq, dtype=torch.int32)),
                query_start_loc=put(qsl), has_tree=put(has), mask=put(mask),
                scale=d ** -0.5, num_kv_heads=hkv), max(q_lens)


def check(case, max_q, dtype, splits=(None, 1, 3), window=None):
    ca = payload_module("attention.triton_tree")
    ref = reference_tree_attention(**case, window=window)
    # auto, one program per query block, keys split over 3; one key loop or two (the
    # context's own; 4-key tiles put the context / tree boundary inside tiles and splits);
    # the splits merged by a second launch or by the last split (fused, twice: the
    # counters must be left at zero for the next launch); the second launch's programs
    # over slices of a block's rows (combine_rows 16 and 1)
    runs = [(sp, two, None, False, None) for sp in splits for two in (False, True)] + \
        [(1, True, 8, False, None), (3, True, 4, False, None), (3, False, None, True, None),
         (3, True, 4, True, None), (3, True, 4, True, None), (3, True, None, False, 16),
         (3, True, None, False, 1)]
    for i, (sp, two, bn, fused, rows) in enumerate(runs):
        out = torch.full_like(case["query"], float("nan"))
        ca.launch(case["query"], case["key_cache"], case["value_cache"], out,
                  case["block_table"], case["seq_lens"], case["query_start_loc"],
                  case["has_tree"], case["mask"], case["scale"], max_q,
                  case["num_kv_heads"], splits=sp, window=window, two_loops=two, block_n=bn,
                  fused_combine=fused, combine_warps=8 if i % 2 else None,
                  combine_rows=rows)
        assert not torch.isnan(out).any()
        err = (out.float() - ref).abs().max().item()
        assert err <= TOL[dtype], (sp, two, bn, fused, err)
        if fused:
            assert not any(b.any() for bufs in ca._counters.values() for b in bufs)
    return out, ref


@pytest.mark.parametrize("dtype", ["half", torch.float32])
def test_trees_and_causal_rows(dtype):
    dev = device()
    if dtype == "half":  # the CPU interpreter has no bf16 arithmetic: fp16 there
        dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    small = dev == "cpu"
    q_lens = [9, 5, 9, 1] if small else [65, 17, 65, 1, 40]
    ctx = [20, 3, 0, 7] if small else [512, 30, 0, 100, 33]
    trees = [True, True, False, False] if small else [True, True, False, False, True]
    case, mq = make_case(dev, dtype, q_lens, ctx, trees, budget=max(q_lens) - 1)
    check(case, mq, dtype)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window(window):
    """A sliding window W: every row sees keys at positions >= its own - W + 1, tree
    rows at root + depth (random trees reach depth > W: ancestors drop out too), the
    context cut for long contexts and whole for short ones; causal rows as usual."""
    dev = device()
    small = dev == "cpu"
    q_lens = [9, 5, 9, 1] if small else [65, 17, 65, 1, 40]
    ctx = [20, 2, 0, 7] if small else [512, 3, 0, 100, 33]
    trees = [True, True, False, False] if small else [True, True, False, False, True]
    case, mq = make_case(dev, torch.float32, q_lens, ctx, trees, budget=max(q_lens) - 1,
                         seed=window, deep=True)
    out, ref = check(case, mq, torch.float32, window=window)
    full = reference_tree_attention(**case)
    assert (full - ref).abs().max() > 1e-2  # the window changed the answer


def test_window_on_a_chain_is_the_causal_window():
    """A chain's tree positions are the linear ones: the windowed tree kernel over a
    chain mask equals the windowed causal rows (an oracle independent of depths)."""
    dev = device()
    core = payload_module("core")
    ca = payload_module("attention.triton_tree")
    n_nodes = 8 if dev == "cpu" else 64
    case, mq = make_case(dev, torch.float32, [n_nodes + 1], [13], [False])
    outs = []
    for has in (0, 1):
        chain = torch.arange(-1, n_nodes - 1).view(1, -1)
        case["mask"][0] = core.ancestor_mask(chain, n_nodes, backend="torch")[0].to(torch.int8)
        case["has_tree"][0] = has
        outs.append(torch.zeros_like(case["query"]))
        ca.launch(case["query"], case["key_cache"], case["value_cache"], outs[-1],
                  case["block_table"], case["seq_lens"], case["query_start_loc"],
                  case["has_tree"], case["mask"], case["scale"], mq, case["num_kv_heads"],
                  window=3)
    assert torch.equal(outs[0], outs[1])


def test_gqa_shapes_qwen3_8b():
    dev = device()
    if dev == "cpu":
        pytest.skip("large shape: CUDA only")
    for hq, hkv, budget, n in [(32, 8, 64, 1), (32, 8, 256, 4), (16, 16, 16, 3), (12, 4, 32, 2)]:
        q = [budget + 1] * n
        case, mq = make_case(dev, torch.bfloat16, q, [512] * n, [True] * n, hq=hq, hkv=hkv,
                             d=128, budget=budget, seed=hq + budget)
        check(case, mq, torch.bfloat16)


def test_chain_mask_equals_causal():
    dev = device()
    core = payload_module("core")
    n_nodes = 8 if dev == "cpu" else 64
    case, mq = make_case(dev, torch.float32, [n_nodes + 1], [13], [False])
    ca = payload_module("attention.triton_tree")
    a = torch.zeros_like(case["query"])
    ca.launch(case["query"], case["key_cache"], case["value_cache"], a, case["block_table"],
              case["seq_lens"], case["query_start_loc"], case["has_tree"], case["mask"],
              case["scale"], mq, case["num_kv_heads"])
    chain = torch.arange(-1, n_nodes - 1).view(1, -1)
    case["mask"][0] = core.ancestor_mask(chain, n_nodes, backend="torch")[0].to(torch.int8)
    case["has_tree"][0] = 1
    b = torch.zeros_like(a)
    ca.launch(case["query"], case["key_cache"], case["value_cache"], b, case["block_table"],
              case["seq_lens"], case["query_start_loc"], case["has_tree"], case["mask"],
              case["scale"], mq, case["num_kv_heads"])
    assert torch.equal(a, b)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_graph_replay_sees_new_trees(fused):
    """fused: 4 key splits merged by the last (its counters must be zero again after
    each replay, or the next replay merges too early or never)."""
    dtype = torch.bfloat16
    n, budget = 3, 32
    case, mq = make_case("cuda", dtype, [budget + 1] * n, [100, 7, 300], [True] * n,
                         hq=32, hkv=8, d=128, budget=budget, seed=1)
    ca = payload_module("attention.triton_tree")
    out = torch.zeros_like(case["query"])

    def run():
        ca.launch(case["query"], case["key_cache"], case["value_cache"], out,
                  case["block_table"], case["seq_lens"], case["query_start_loc"],
                  case["has_tree"], case["mask"], case["scale"], mq, case["num_kv_heads"],
                  **({"splits": 4, "fused_combine": True} if fused else {}))

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for seed in (5, 6, 7):  # new trees / queries / cache content / which rows have trees
        new, _ = make_case("cuda", dtype, [budget + 1] * n, [100, 7, 300],
                           [seed != 6, True, seed != 7], hq=32, hkv=8, d=128, budget=budget,
                           seed=seed)
        for key in ("query", "has_tree", "mask"):
            case[key].copy_(new[key])
        case["key_cache"].copy_(new["key_cache"])
        case["value_cache"].copy_(new["value_cache"])
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = reference_tree_attention(**case)
        err = (out.float() - ref).abs().max().item()
        assert err <= TOL[dtype], (seed, err)
        if fused:
            assert not any(b.any() for bufs in ca._counters.values() for b in bufs)


@pytest.mark.parametrize("dtype", [torch.float32, "half"])
def test_heads_packed_layout_of_032(dtype):
    """vLLM 0.32/0.33 FA/Triton caches are [blocks, Hkv, block_size, 2*D] (K | V on the
    last dim): split_kv gives the views the kernel reads; same output as the oracle."""
    dev = device()
    if dtype == "half":  # the CPU interpreter has no bf16 arithmetic: fp16 there
        dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    ca = payload_module("attention.triton_tree")
    case, max_q = make_case(dev, dtype, q_lens=[9, 1, 5], ctx_lens=[20, 7, 33],
                            trees=[True, False, True], budget=8, seed=5)
    k, v = case["key_cache"], case["value_cache"]  # [blocks, bs, Hkv, D]
    packed = torch.cat([k, v], dim=-1).permute(0, 2, 1, 3).contiguous()
    pk, pv = ca.split_kv(packed, "heads_packed", k.shape[-1])
    assert torch.equal(pk, k) and torch.equal(pv, v)
    check(dict(case, key_cache=pk, value_cache=pv), max_q, dtype, splits=(None,))


def test_fused_combine_counters_per_stream_kept_alive():
    """fused_combine's arrival counters: one zeroed buffer per (device, stream), the same
    buffer for every launch that fits (a captured graph keeps its address), a bigger
    one when needed with the smaller kept alive (graphs captured with it)."""
    ca = payload_module("attention.triton_tree")
    saved = dict(ca._counters)
    try:
        ca._counters.clear()
        a = ca.counters("cpu", 10)
        assert a.dtype == torch.int32 and a.numel() >= 10 and not a.any()
        assert ca.counters(torch.device("cpu"), 100) is a  # fits: the same buffer
        b = ca.counters("cpu", a.numel() + 1)
        assert b.numel() > a.numel() and ca._counters[("cpu", 0)] == [a, b]
        if HAS_CUDA:
            c = ca.counters("cuda", 10)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                d = ca.counters("cuda", 10)
            assert c is not d and len(ca._counters) == 3
    finally:
        ca._counters.clear()
        ca._counters.update(saved)
