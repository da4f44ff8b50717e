import pytest
import torch
from core_helpers import CUDA, DEV, needs_cuda, needs_triton

from ddtree_patcher.patches.ddtree.payload.core import compact_kv, compact_kv_slots, compaction_slots, token_view

SHAPES = {
    "kv_in_block": lambda nb, bs, h, d: (nb, 2, bs, h, d),
    "kv_outer": lambda nb, bs, h, d: (2, nb, bs, h, d),
    "heads_packed": lambda nb, bs, h, d: (nb, h, bs, 2 * d),
}


def _naive(kvs, bt, bs, start, rows, nacc, layout):
    out = [k.clone() for k in kvs]
    for src_kv, dst_kv in zip(kvs, out):
        a, b = token_view(src_kv, layout), token_view(dst_kv, layout)
        for n in range(rows.shape[0]):
            for j in range(1, int(nacc[n]) + 1):
                sp, dp = int(start[n]) + int(rows[n, j]), int(start[n]) + j
                b[int(bt[n, dp // bs]), dp % bs] = a[int(bt[n, sp // bs]), sp % bs]
    return out


def _case(g, layout, n=3, bs=4, h=2, d=3, L=5, bmax=9, nb=48, layers=3, physical="plain", dtype=torch.float32):
    shape = SHAPES[layout](nb, bs, h, d)
    if physical == "one_buffer":  # layers as views of one allocation, like vLLM's raw buffer
        big = torch.randn(layers, *shape, generator=g).to(dtype)
        kvs = [big[i] for i in range(layers)]
    else:
        kvs = [torch.randn(*shape, generator=g).to(dtype) for _ in range(layers)]
        if physical == "hnd" and layout != "heads_packed":  # swap block_size/heads physically
            kvs = [k.transpose(-2, -3).contiguous().transpose(-2, -3) for k in kvs]
        if physical == "hnd" and layout == "heads_packed":  # NHD physical order
            kvs = [k.transpose(1, 2).contiguous().transpose(1, 2) for k in kvs]
    per = (max(20, bmax + 20) + bs - 1) // bs + 1
    bt = torch.randperm(nb, generator=g)[: n * per].reshape(n, per).int()
    start = torch.randint(0, 16, (n,), generator=g)
    rows = torch.full((n, L + 1), -1)
    rows[:, 0] = 0
    nacc = torch.randint(0, L + 1, (n,), generator=g)
    nacc[0] = L
    for i in range(n):
        r = sorted((torch.randperm(bmax, generator=g)[: int(nacc[i])] + 1).tolist())
        if i == 0:
            r = list(range(1, L + 1))  # already in place: nothing moves
        rows[i, 1: len(r) + 1] = torch.tensor(r, dtype=torch.int64)
    return kvs, bt, bs, start, rows, nacc


@pytest.mark.parametrize("layout", list(SHAPES))
@pytest.mark.parametrize("physical", ["plain", "hnd", "one_buffer"])
def test_torch_reference(layout, physical):
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        kvs, bt, bs, start, rows, nacc = _case(g, layout, physical=physical)
        exp = _naive(kvs, bt, bs, start, rows, nacc, layout)
        kd = [k.to(DEV) for k in kvs]
        compact_kv(kd, bt.to(DEV), bs, start.to(DEV), rows.to(DEV), nacc.to(DEV), layout, backend="torch")
        for x, y in zip(kd, exp):
            assert torch.equal(x.cpu(), y)


def test_overlap_chain():
    """rows 2,3,4,5 -> 1,2,3,4: each destination is the previous source."""
    g = torch.Generator().manual_seed(1)
    kvs, bt, bs, start, rows, nacc = _case(g, "kv_in_block", n=1)
    rows[0] = torch.tensor([0, 2, 3, 4, 5, 6])
    nacc[0] = 5
    exp = _naive(kvs, bt, bs, start, rows, nacc, "kv_in_block")
    compact_kv(kvs, bt, bs, start, rows, nacc, "kv_in_block", backend="torch")
    for x, y in zip(kvs, exp):
        assert torch.equal(x, y)


def test_slots_helper():
    bt = torch.tensor([[5, 2, 7]])
    src, dst = compaction_slots(bt, 4, torch.tensor([3]), torch.tensor([[0, 1, 4, 6]]), torch.tensor([3]))
    # positions: start 3; j=1 row 1 in place; j=2 row 4 -> pos 7 (blk 1 -> 2, off 3) to pos 5 (blk 2, off 1)
    assert src.tolist() == [[-1, 2 * 4 + 3, 7 * 4 + 1]]
    assert dst.tolist() == [[-1, 2 * 4 + 1, 2 * 4 + 2]]


@needs_triton
@pytest.mark.parametrize("layout", list(SHAPES))
def test_triton_matches_reference(layout):
    g = torch.Generator().manual_seed(2)
    for physical in ("plain", "hnd", "one_buffer"):
        kvs, bt, bs, start, rows, nacc = _case(g, layout, physical=physical)
        if CUDA:
            kvs, bt, start, rows, nacc = [k.cuda() for k in kvs], bt.cuda(), start.cuda(), rows.cuda(), nacc.cuda()
        exp = [k.clone() for k in kvs]
        compact_kv(exp, bt, bs, start, rows, nacc, layout, backend="torch")
        compact_kv(kvs, bt, bs, start, rows, nacc, layout, backend="triton")
        for x, y in zip(kvs, exp):
            assert torch.equal(x, y)
        src, dst = compaction_slots(bt, bs, start, rows, nacc)
        # slot-based entry point, applied once more to both copies
        compact_kv_slots(kvs, src, dst, bs, layout, backend="triton")
        compact_kv_slots(exp, src, dst, bs, layout, backend="torch")
        for x, y in zip(kvs, exp):
            assert torch.equal(x, y)


@needs_cuda
def test_cuda_realistic_and_graph():
    g = torch.Generator().manual_seed(3)
    for layout in SHAPES:
        kvs, bt, bs, start, rows, nacc = _case(g, layout, n=8, bs=16, h=8, d=128, L=15, bmax=64, nb=8 * 40,
                                               layers=4, dtype=torch.bfloat16)
        kvs = [k.cuda() for k in kvs]
        bt, start, rows, nacc = bt.cuda(), start.cuda(), rows.cuda(), nacc.cuda()
        orig = [k.clone() for k in kvs]
        exp = [k.clone() for k in kvs]
        compact_kv(exp, bt, bs, start, rows, nacc, layout, backend="torch")
        compact_kv(kvs, bt, bs, start, rows, nacc, layout)  # eager Triton, also warms the caches
        for x, y in zip(kvs, exp):
            assert torch.equal(x, y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compact_kv(kvs, bt, bs, start, rows, nacc, layout)
        for k, o in zip(kvs, orig):
            k.copy_(o)
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(kvs, exp):
            assert torch.equal(x, y)
