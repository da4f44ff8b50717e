"""vocab_topk's select stage spread over programs (impl='split'): the same top K.

The one-program select (vocab_topk._select_kernel) runs two sorts of up to 4096 keys
in one program per row: at 1 request (15 drafter rows) that is 15 programs on a GPU of
132 SMs, 69 us of the H100's tree step (run 26).  Here every sort is of GS keys, and a
row's work is spread over several programs (all launches graph-capturable, no sync):

  part:    as before: per chunk (max, sum exp) and the largest key of every sub-block.
  groups:  grid (rows, NG): the top KP of each group of GS sub-maxima (skipped when a
           row has at most GS of them).
  gather:  grid (rows, NG2): each program takes the top KP sub-maxima of the groups'
           tops (the same in every program), keeps its KP / NG2 of those sub-blocks,
           gathers their tokens and stores their top KP.
  final:   grid (rows,): the top KP of the NG2 * KP gathered keys, the lse, the output.

Exact for the reason the one-program select is (vocab_topk's docstring): the top KP of
the groups' tops are the top KP sub-maxima; every top-K token lies in one of their
sub-blocks; each sub-block goes to exactly one gather program, whose top KP keeps every
top-K token it holds; the final top KP of their union is the row's.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, next_pow2, tl, triton
from .vocab_topk import _chunk, _rows, pick_sub

GS = 512  # keys a sort of this path holds (at least 2 * KP)


def plan(v: int, k: int) -> dict:
    """Launch shape for a row of v tokens and top k: the one-program select's chunks and
    sub-blocks (vocab_topk._plan), then this path's groups."""
    ch, sub, kp = _chunk(v), pick_sub(v, k), max(2, next_pow2(k))
    nch = -(-v // ch)
    nsub = nch * (ch // sub)
    gs = max(GS, 2 * kp)
    ng = -(-nsub // gs)
    na = nsub if ng == 1 else ng * kp  # keys the gather programs read a row
    # gather programs a row: each takes KP / NG2 sub-blocks, at least KP tokens
    ng2 = max(1, min(sub, kp, kp * sub // gs))
    return dict(ch=ch, nch=nch, sub=sub, nsub=nsub, kp=kp, gs=gs, ng=ng, na=na,
                ap=max(kp, next_pow2(na)), ng2=ng2, bpg=kp // ng2)


def vocab_topk_split(x: torch.Tensor, k: int, with_lse: bool):
    rows = _rows(x)
    nr, v = rows.shape
    p = plan(v, k)
    dev = x.device
    f32 = dict(device=dev, dtype=torch.float32)
    i64 = dict(device=dev, dtype=torch.int64)
    m = torch.empty(nr, p["nch"], **f32)
    sx = torch.empty(nr, p["nch"], **f32)
    subs = torch.empty(nr, p["nsub"], **i64)
    vals = torch.empty(nr, k, **f32)
    ids = torch.empty(nr, k, **i64)
    lse = torch.empty(nr, **f32)
    kp = p["kp"]
    _part_kernel[(nr, p["nch"])](rows, m, sx, subs, rows.stride(0), v, p["nch"],
                                 CH=p["ch"], SUB=p["sub"], WITH_SUB=True, num_warps=4)
    tops = subs
    if p["ng"] > 1:
        tops = torch.empty(nr, p["ng"] * kp, **i64)
        _groups_kernel[(nr, p["ng"])](subs, tops, p["nsub"], GS=p["gs"], KP=kp,
                                      num_warps=_warps(p["gs"]))
    cand = torch.empty(nr, p["ng2"] * kp, **i64)
    warps = _warps(max(p["ap"], p["bpg"] * p["sub"]))
    _gather_kernel[(nr, p["ng2"])](rows, tops, cand, rows.stride(0), v, p["na"],
                                   AP=p["ap"], KP=kp, SUB=p["sub"], NG2=p["ng2"],
                                   BPG=p["bpg"], num_warps=warps)
    _final_kernel[(nr,)](m, sx, cand, vals, ids, lse, p["nch"], k,
                         NCHP=max(2, next_pow2(p["nch"])), CP=p["ng2"] * kp, KP=kp,
                         WITH_LSE=with_lse, num_warps=_warps(p["ng2"] * kp))
    lead = x.shape[:-1]
    return vals.view(*lead, k), ids.view(*lead, k), (lse.view(lead) if with_lse else None)


def _warps(n: int) -> int:
    return 4 if n <= 1024 else 8


if HAS_TRITON:
    from .vocab_topk import _okey, _part_kernel, _store_lse, _store_top

    @triton.jit
    def _groups_kernel(src_ptr, dst_ptr, N, GS: tl.constexpr, KP: tl.constexpr):
        """dst[row, g * KP:(g + 1) * KP] = the top KP of src[row, g * GS:(g + 1) * GS]."""
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        j = g * GS + tl.arange(0, GS)
        keys = tl.load(src_ptr + row * N + j, mask=j < N, other=-9223372036854775808)
        top = tl.topk(keys, KP)
        tl.store(dst_ptr + (row * tl.num_programs(1) + g) * KP + tl.arange(0, KP), top)

    @triton.jit
    def _gather_kernel(x_ptr, tops_ptr, cand_ptr, stride_row, V, NA, AP: tl.constexpr,
                       KP: tl.constexpr, SUB: tl.constexpr, NG2: tl.constexpr,
                       BPG: tl.constexpr):
        """The top KP sub-maxima of the row; this program's BPG of their sub-blocks;
        the top KP keys of those tokens -> cand[row, g * KP:(g + 1) * KP]."""
        I64_MIN: tl.constexpr = -9223372036854775808
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        j = tl.arange(0, AP)
        a = tl.load(tops_ptr + row * NA + j, mask=j < NA, other=I64_MIN)
        top = tl.reshape(tl.topk(a, KP), [NG2, BPG])
        # row g of [NG2, BPG] (the other rows summed as zeros)
        mine = tl.sum(tl.where(tl.arange(0, NG2)[:, None] == g, top, 0), 0)
        blk = (1048575 - (mine & 1048575)) // SUB
        ids = blk[:, None] * SUB + tl.arange(0, SUB)[None, :]
        ok = (mine > I64_MIN)[:, None] & (ids < V)
        y = tl.load(x_ptr + row * stride_row + ids, mask=ok, other=0.0).to(tl.float32)
        key = tl.where(ok, _okey(y, ids), I64_MIN)
        best = tl.topk(tl.reshape(key, [BPG * SUB]), KP)
        tl.store(cand_ptr + (row * NG2 + g) * KP + tl.arange(0, KP), best)

    @triton.jit
    def _final_kernel(m_ptr, s_ptr, cand_ptr, vals_ptr, ids_ptr, lse_ptr, NCH, K,
                      NCHP: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr,
                      WITH_LSE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if WITH_LSE:
            _store_lse(m_ptr, s_ptr, lse_ptr, row, NCH, NCHP)
        best = tl.topk(tl.load(cand_ptr + row * CP + tl.arange(0, CP)), KP)
        _store_top(best, vals_ptr, ids_ptr, row, K, KP)
