"""One pass over the drafter's [R, V] logits: the top K tokens of every row and its
log-sum-exp, on the device, no host sync (CUDA-graph capturable).

Which K (the rule every path follows): the K largest by (value descending, token id
ascending), i.e. on an exact tie at the K-th place the lower ids enter.  Values are
compared as float32 (bf16/fp16 convert exactly), NaN and +inf count as -inf (in the
log-sum-exp too: a non-finite entry is an excluded token) and -0.0 as
+0.0.  Keys make the rule a plain integer order:

    key = (ordered float bits << TOK_BITS) | (2**TOK_BITS - 1 - id)

(ordered bits: the sign-magnitude float bits as a two's-complement int whose order is
the float order), so the K largest keys are the K tokens; keys are unique.

Fused Triton path (two launches):
  part:   grid (rows, chunks of CH tokens): per chunk (max, sum exp) for the lse, and
          the largest key of every sub-block of SUB tokens ("sub-maxima").
  select: one program per row: the lse from the chunk partials; the top K' = pow2 >= K
          sub-maxima; all tokens of those K' sub-blocks; their top K.
Why it is exact: the K' largest sub-maxima are K' distinct tokens, so the K-th largest
key k* of the row is >= the K'-th largest sub-maximum t.  Every top-K token has key
>= k* >= t, so its sub-block's maximum is >= t: that sub-block is one of the K'
gathered (sub-maxima are unique).  The gathered tokens therefore hold the top K.
SUB ~ sqrt(V / K) balances the two sorts (V / SUB sub-maxima, K' * SUB candidates).

``vocab_topk(x, k)`` returns (values float32 [..., k] in key order, ids int64, lse
float32 [...] or None); ``impl='torch'`` is the reference (torch.topk on the keys).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, interpreting, next_pow2, tl, triton

TOK_BITS = 20  # vocab ids must be < 2**20
LOW = (1 << TOK_BITS) - 1
CH_MAX = 4096  # tokens per chunk of the part kernel (and of row_logsumexp)
FUSED_MAX = 16384  # largest sort of the select kernel; beyond it 'auto' uses torch
# 'auto' takes the fused path up to this K: its cost grows with K while torch.topk's
# hardly does (H200, V = 151936, CUDA graphs: fused wins at K <= 64 for 15-1920 rows,
# 2-3x; torch.topk wins at K >= 256 but for 120 rows; bench/RESULTS.md, run 6)
FUSED_AUTO_MAX_K = 128
# the fused path's select stage under 'auto': "one" program a row (measured, run 6) or
# "split" over programs (vocab_topk_split.py: exact, not yet timed on a GPU; the
# device benches set it to compare the two in one engine)
AUTO_SELECT = "one"


def order_keys(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """[..., V] values (token ids: the last index, or ``ids``) -> int64 keys."""
    f = x.float()
    f = torch.where(torch.isnan(f) | torch.isposinf(f), float("-inf"), f)
    f = torch.where(f == 0, 0.0, f)  # -0.0 -> +0.0
    b = f.view(torch.int32)
    o = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(torch.int64)
    if ids is None:
        ids = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return (o << TOK_BITS) | (LOW - ids.to(torch.int64))


def decode_keys(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 keys -> (float32 values, int64 ids)."""
    o = (key >> TOK_BITS).to(torch.int32)
    b = o ^ ((o >> 31) & 0x7FFFFFFF)
    return b.view(torch.float32), LOW - (key & LOW)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """float32 logsumexp over the last dim.  On CUDA: per-chunk (max, sum exp) in
    parallel (Triton, reads bf16/fp16 without a float copy), finished in torch."""
    if HAS_TRITON and x.is_cuda:
        rows = _rows(x)
        nr, v = rows.shape
        ch = _chunk(v)
        nch = triton.cdiv(v, ch)
        m = torch.empty(nr, nch, device=x.device, dtype=torch.float32)
        sx = torch.empty(nr, nch, device=x.device, dtype=torch.float32)
        _part_kernel[(nr, nch)](rows, m, sx, m, rows.stride(0), v, nch, CH=ch, SUB=1,
                                WITH_SUB=False, num_warps=4)
        mx = m.amax(-1, keepdim=True)
        safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        tot = (sx * torch.exp(m - safe)).sum(-1)
        out = safe.squeeze(-1) + torch.log(tot)
        return out.reshape(x.shape[:-1])
    f = x.float()
    return torch.logsumexp(torch.where(torch.isfinite(f), f, float("-inf")), dim=-1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _chunk(v: int) -> int:
    return min(CH_MAX, max(16, next_pow2(v)))


def pick_sub(v: int, k: int) -> int:
    """Sub-block size for the fused path: the power of two that keeps both sorts of the
    select kernel smallest (largest of the two, then their sum)."""
    return _plan(v, k)[1]


def _plan(v: int, k: int) -> tuple[int, int]:
    """(largest sort, sub-block size) of the fused select kernel."""
    kp, ch = max(2, next_pow2(k)), _chunk(v)
    best = None
    sub = 1
    while sub <= ch:
        nsubp = max(kp, next_pow2(-(-v // ch) * (ch // sub)))
        cost = (max(nsubp, kp * sub), nsubp + kp * sub)
        if best is None or cost < best[0]:
            best = (cost, sub)
        sub *= 2
    return best[0][0], best[1]


def vocab_topk(x: torch.Tensor, k: int, with_lse: bool = True, impl: str = "auto"):
    """Top k of the last dim by (value desc, id asc), and the float32 logsumexp.

    x [..., V] float32/bf16/fp16; 1 <= k <= V < 2**20.  impl: 'auto' (fused Triton on
    CUDA for k <= FUSED_AUTO_MAX_K while its sorts stay <= FUSED_MAX elements, its
    select stage as AUTO_SELECT says; else torch), 'fused' (one select program a row;
    CUDA, or CPU under TRITON_INTERPRET=1), 'split' (the select over several programs,
    vocab_topk_split.py; k <= FUSED_AUTO_MAX_K), 'torch'.
    Returns (values float32 [..., k], ids int64 [..., k], lse [...] or None); values
    and ids are in key order (largest first).
    """
    v = x.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"k must be in 1..{v}, got {k}")
    if v > (1 << TOK_BITS):
        raise ValueError("vocab larger than 2**20 is not supported")
    if impl == "auto":
        fused = HAS_TRITON and x.is_cuda and k <= FUSED_AUTO_MAX_K and \
            _plan(v, k)[0] <= FUSED_MAX
        split = fused and AUTO_SELECT == "split"
    elif impl in ("fused", "split"):
        if not HAS_TRITON or not (x.is_cuda or interpreting()):
            raise RuntimeError(f"impl={impl!r} needs triton and CUDA tensors (or TRITON_INTERPRET=1)")
        if impl == "split" and k > FUSED_AUTO_MAX_K:
            raise ValueError(f"impl='split' takes k <= {FUSED_AUTO_MAX_K}, got {k}")
        fused, split = True, impl == "split"
    elif impl == "torch":
        fused = False
    else:
        raise ValueError(f"unknown impl {impl!r}")
    if fused and split:
        from .vocab_topk_split import vocab_topk_split

        return vocab_topk_split(x, k, with_lse)
    if fused:
        return _vocab_topk_triton(x, k, with_lse)
    top = torch.topk(order_keys(x), k, dim=-1).values
    vals, ids = decode_keys(top)
    return vals, ids, (row_logsumexp(x) if with_lse else None)


def _vocab_topk_triton(x, k, with_lse):
    rows = _rows(x)
    nr, v = rows.shape
    dev = x.device
    ch = _chunk(v)
    sub = pick_sub(v, k)
    nch = triton.cdiv(v, ch)
    nsub = nch * (ch // sub)
    kp = max(2, next_pow2(k))
    nsubp = max(kp, next_pow2(nsub))
    f32 = dict(device=dev, dtype=torch.float32)
    m = torch.empty(nr, nch, **f32)
    sx = torch.empty(nr, nch, **f32)
    subs = torch.empty(nr, nsub, device=dev, dtype=torch.int64)
    vals = torch.empty(nr, k, **f32)
    ids = torch.empty(nr, k, device=dev, dtype=torch.int64)
    lse = torch.empty(nr, **f32)
    _part_kernel[(nr, nch)](rows, m, sx, subs, rows.stride(0), v, nch, CH=ch, SUB=sub,
                            WITH_SUB=True, num_warps=4)
    big = max(nsubp, kp * sub)
    warps = 4 if big <= 1024 else (8 if big <= 4096 else 16)
    _select_kernel[(nr,)](rows, m, sx, subs, vals, ids, lse, rows.stride(0), v, nch, nsub, k,
                          NCHP=max(2, next_pow2(nch)), NSUBP=nsubp, KP=kp, SUB=sub,
                          WITH_LSE=with_lse, num_warps=warps)
    lead = x.shape[:-1]
    return vals.view(*lead, k), ids.view(*lead, k), (lse.view(lead) if with_lse else None)


if HAS_TRITON:

    @triton.jit
    def _okey(x, ids):
        """float32 values + token ids -> int64 keys (order_keys)."""
        x = tl.where((x != x) | (x == float("inf")), float("-inf"), x)
        x = tl.where(x == 0.0, 0.0, x)
        b = x.to(tl.int32, bitcast=True)
        o = b ^ ((b >> 31) & 0x7FFFFFFF)
        return (o.to(tl.int64) << 20) | (1048575 - ids.to(tl.int64))

    @triton.jit
    def _part_kernel(x_ptr, m_ptr, s_ptr, sub_ptr, stride_row, V, NCH,
                     CH: tl.constexpr, SUB: tl.constexpr, WITH_SUB: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        v = c * CH + tl.arange(0, CH)
        x = tl.load(x_ptr + row * stride_row + v, mask=v < V, other=float("-inf")).to(tl.float32)
        x = tl.where((x != x) | (x == float("inf")), float("-inf"), x)  # non-finite: excluded
        mx = tl.max(x, 0)
        safe = tl.where(mx > float("-inf"), mx, 0.0)
        tl.store(m_ptr + row * NCH + c, mx)
        tl.store(s_ptr + row * NCH + c, tl.sum(tl.exp(x - safe), 0))
        if WITH_SUB:
            NS: tl.constexpr = CH // SUB
            ids = c * CH + tl.arange(0, NS)[:, None] * SUB + tl.arange(0, SUB)[None, :]
            ok = ids < V
            y = tl.load(x_ptr + row * stride_row + ids, mask=ok, other=0.0).to(tl.float32)
            key = tl.where(ok, _okey(y, ids), -9223372036854775808)
            tl.store(sub_ptr + (row * NCH + c) * NS + tl.arange(0, NS), tl.max(key, 1))

    @triton.jit
    def _select_kernel(x_ptr, m_ptr, s_ptr, sub_ptr, vals_ptr, ids_ptr, lse_ptr, stride_row,
                       V, NCH, NSUB, K, NCHP: tl.constexpr, NSUBP: tl.constexpr,
                       KP: tl.constexpr, SUB: tl.constexpr, WITH_LSE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        I64_MIN: tl.constexpr = -9223372036854775808
        if WITH_LSE:
            _store_lse(m_ptr, s_ptr, lse_ptr, row, NCH, NCHP)
        j = tl.arange(0, NSUBP)
        subs = tl.load(sub_ptr + row * NSUB + j, mask=j < NSUB, other=I64_MIN)
        top = tl.topk(subs, KP)  # the KP largest sub-maxima
        blk = (1048575 - (top & 1048575)) // SUB
        ids = blk[:, None] * SUB + tl.arange(0, SUB)[None, :]
        ok = (top > I64_MIN)[:, None] & (ids < V)
        y = tl.load(x_ptr + row * stride_row + ids, mask=ok, other=0.0).to(tl.float32)
        key = tl.where(ok, _okey(y, ids), I64_MIN)
        _store_top(tl.topk(tl.reshape(key, [KP * SUB]), KP), vals_ptr, ids_ptr, row, K, KP)

    @triton.jit
    def _store_lse(m_ptr, s_ptr, lse_ptr, row, NCH, NCHP: tl.constexpr):
        """The row's log-sum-exp from its chunks' (max, sum exp)."""
        c = tl.arange(0, NCHP)
        mc = tl.load(m_ptr + row * NCH + c, mask=c < NCH, other=float("-inf"))
        sc = tl.load(s_ptr + row * NCH + c, mask=c < NCH, other=0.0)
        mx = tl.max(mc, 0)
        safe = tl.where(mx > float("-inf"), mx, 0.0)
        tl.store(lse_ptr + row, safe + tl.log(tl.sum(sc * tl.exp(mc - safe), 0)))

    @triton.jit
    def _store_top(best, vals_ptr, ids_ptr, row, K, KP: tl.constexpr):
        """The first K of the KP keys ``best`` (largest first) as values and token ids."""
        o = (best >> 20).to(tl.int32)
        val = (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        kk = tl.arange(0, KP)
        tl.store(vals_ptr + row * K + kk, val, mask=kk < K)
        tl.store(ids_ptr + row * K + kk, 1048575 - (best & 1048575), mask=kk < K)


__all__ = ["vocab_topk", "row_logsumexp", "order_keys", "decode_keys", "pick_sub", "TOK_BITS"]
