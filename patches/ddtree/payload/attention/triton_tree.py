"""Tree attention for vLLM's CUDA backends (FLASH_ATTN, FLEX_ATTENTION): DDTree verify.

Neither FA3 nor the FlexAttention backend takes a per-request mask, so a verify step
runs this Triton paged-attention kernel instead (hooked into both backends' forward
by the ddtree-sampler transform).  Every query row of request r sees the request's
whole context (``seq_len - q_len`` cached tokens) and, among this step's rows:

  * with a tree (``has_tree[r] != 0``): the rows its ancestor-or-self mask allows,
    ``mask[r, i, j]`` over verify rows (row 0 = root, row 1 + k = tree node k);
  * without one: the rows before it and itself (plain causal: prefill chunks,
    requests without drafts, drafts verified as a chain).

It reads K/V from the paged cache ([num_blocks, block_size, kv_heads, head_size]
per K and V, any strides: the FA/Flex layouts), which the backends fill before
``forward`` (``forward_includes_kv_cache_update = False``).

CUDA graphs: the launch depends only on the batch shape (number of requests, the
metadata's ``max_query_len``) and on tensors at fixed addresses (the runner's
persistent query_start_loc / seq_lens / block table, and the ``TreeState`` buffers
that the runtime fills before every forward), so a FULL graph captured with it
replays correctly with any trees.  Rows with ``has_tree = 0`` are causal, so the
same graph is right for batches without trees.

``reference/tree_attention.py`` (not shipped) is the torch version (fp32 math), used by the tests;
the CPU backend's ``cpu_attention.tree_attention`` is the same rule over the CPU
cache layout.
"""

from __future__ import annotations

import torch

from .. import envs
from .features import check, window_of
from .tiles import head_view
from ..core._triton import HAS_TRITON, interpreting, next_pow2, tl, triton


SPLIT_MIN_PROGRAMS = 132  # H100/H200 SM count: fewer programs than this -> split the keys
MAX_SPLITS = 8

# Launch configs by the step's query rows (num_reqs * max_query_len): the first entry
# whose bound is >= rows wins; missing fields keep the defaults (block_q = 64 // G query
# tokens per program, 64-key tiles, automatic key splits, 4 warps, Triton's stages, one
# key loop; two_loops: the context tiles in a loop of their own, without the tree mask;
# fused_combine: the key splits merged by the last one to finish, not a second launch;
# combine_warps / combine_rows: the warps of that second launch (4) and the rows one of
# its programs merges (default: a whole query block; at 1 request that is 32 programs).
# VLLM_DDTREE_ATTN_TUNING=<json file> replaces the table, read at the first launch
# (bench/gpu/attn_sweep.py writes one from measurements).
TUNING: list[dict] = [  # H100, bench/gpu/attn_sweep.py, runs 24-25 (bench/RESULTS.md)
    {"max_rows": 96, "block_q": 16, "block_n": 32, "splits": 4, "two_loops": True,
     "num_warps": 8, "num_stages": 3},
    {"max_rows": 512, "block_q": 16, "block_n": 32, "splits": 4, "two_loops": True,
     "combine_rows": 16},
    {"max_rows": 2048, "block_q": 16, "block_n": 32, "splits": 1, "two_loops": True},
]
_loaded: dict[str, list] = {}  # tuning file -> its table


def tuning() -> list[dict]:
    """TUNING, or the table in $VLLM_DDTREE_ATTN_TUNING (read once per file)."""
    path = envs.attn_tuning()
    if path is None:
        return TUNING
    if path not in _loaded:
        _loaded[path] = envs.attn_tuning_table(path)
    return _loaded[path]


def pick_config(rows: int) -> dict:
    for t in tuning():
        if rows <= t["max_rows"]:
            return t
    return {}


class TreeState:
    """Static per-step tree inputs of the kernel (fixed addresses: CUDA-graph safe),
    and the split mode (ddtree_split_attn) of the runtime that fills them."""

    def __init__(self, max_reqs: int, budget: int, device, split: str = "auto"):
        rows = budget + 1
        self.rows = rows
        self.split = split
        self.has_tree = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.mask = torch.zeros(max_reqs, rows, rows, dtype=torch.int8, device=device)


if HAS_TRITON:
    from .tiles import (merge_state, online_update, query_rows, row_index, rows_at, tile_scores,
                        tree_depth)

    @triton.jit
    def _paged_keys(start, kend, bt_row, block_size, BLOCK_N: tl.constexpr):
        """A tile's key positions, which are < kend, and their cache block and offset."""
        kk = start + tl.arange(0, BLOCK_N)
        km = kk < kend
        blk = tl.load(bt_row + kk // block_size, mask=km, other=0).to(tl.int64)
        return kk, km, blk, (kk % block_size).to(tl.int64)

    @triton.jit
    def _paged_load(X, blk, off, km, d, dm, s_b, s_t, s_h, kvh):
        """K or V rows of a tile from the paged cache (0 where masked)."""
        return tl.load(X + blk[:, None] * s_b + off[:, None] * s_t + kvh * s_h + d[None, :],
                       mask=km[:, None] & dm[None, :], other=0.0)

    @triton.jit
    def _tile(start, m_i, l_i, acc, q, K, V, bt_row, mask_row, qi, row_ok, d, dm, ctx, kend,
              has, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_mi, scale, kvh, block_size, qrel,
              window, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, RP: tl.constexpr,
              WINDOW: tl.constexpr):
        """One key tile: scores, tree/causal visibility (and the sliding window: keys at
        relative positions > qrel - window), online-softmax update."""
        kk, km, blk, off = _paged_keys(start, kend, bt_row, block_size, BLOCK_N)
        k = _paged_load(K, blk, off, km, d, dm, s_kb, s_kt, s_kh, kvh)
        s = tile_scores(q, k, scale, IEEE)
        j = kk - ctx
        new = (j >= 0) & km
        tm = tl.load(mask_row + qi[:, None] * s_mi + j[None, :],
                     mask=row_ok[:, None] & new[None, :] & has, other=0)
        causal = j[None, :] <= qi[:, None]
        vis = tl.where(has, tm != 0, causal) | (j < 0)[None, :]
        vis = vis & km[None, :] & row_ok[:, None]
        if WINDOW:
            krel = tl.where(new, tree_depth(mask_row, s_mi, tl.where(new, j, 0), new, has, RP),
                            j)
            vis = vis & (krel[None, :] > qrel[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        v = _paged_load(V, blk, off, km, d, dm, s_vb, s_vt, s_vh, kvh)
        return online_update(s, m_i, l_i, acc, v, IEEE)

    @triton.jit
    def _ctx_tile(start, m_i, l_i, acc, q, K, V, bt_row, row_ok, d, dm, cend, ctx, s_kb, s_kt,
                  s_kh, s_vb, s_vt, s_vh, scale, kvh, block_size, qrel, window,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr):
        """A key tile of committed context only (keys < cend <= ctx): every row sees it
        (but for the sliding window), so no tree mask is loaded."""
        kk, km, blk, off = _paged_keys(start, cend, bt_row, block_size, BLOCK_N)
        k = _paged_load(K, blk, off, km, d, dm, s_kb, s_kt, s_kh, kvh)
        s = tile_scores(q, k, scale, IEEE)
        vis = km[None, :] & row_ok[:, None]
        if WINDOW:
            vis = vis & ((kk - ctx)[None, :] > qrel[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        v = _paged_load(V, blk, off, km, d, dm, s_vb, s_vt, s_vh, kvh)
        return online_update(s, m_i, l_i, acc, v, IEEE)

    @triton.jit
    def _tree_attn_kernel(Q, K, V, O, BT, SEQ, QSL, HAS, MASK, PM, PL, PACC, CNT,
                          s_qt, s_qh, s_ot, s_oh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                          s_bt, s_mr, s_mi, scale, block_size, NQB, NKV, window,
                          G: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr,
                          BLOCK_N: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                          IEEE: tl.constexpr, USE_FOR: tl.constexpr, S: tl.constexpr,
                          RP: tl.constexpr, WINDOW: tl.constexpr, TWO_LOOPS: tl.constexpr,
                          FUSED: tl.constexpr):
        # one program = one request x BLOCK_Q query tokens x one KV head (all G query
        # heads of it: M >= BLOCK_Q * G rows, GQA packed like unified_attention) x one
        # of S key splits (S > 1: partial softmax state to PM/PL/PACC, then _combine;
        # FUSED: the group's last split to finish merges them, counted in CNT)
        r = tl.program_id(0)
        qb = tl.program_id(1)
        kvh = tl.program_id(2) // S
        sp = tl.program_id(2) % S
        q0 = tl.load(QSL + r)
        q_len = tl.load(QSL + r + 1) - q0
        if qb * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(SEQ + r)
        ctx = seq_len - q_len
        qi, h, row_ok, d, dm, tok, q = query_rows(Q, q0, q_len, qb, kvh, s_qt, s_qh,
                                                   G, BLOCK_Q, M, D, DP)
        m = tl.arange(0, M)
        has = tl.load(HAS + r) != 0
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, DP], tl.float32)
        # ancestors precede their descendants: no row of this block sees past kend
        hi = (qb + 1) * BLOCK_Q
        kend = ctx + q_len
        if hi < q_len:
            kend = ctx + hi
        bt_row = BT + r.to(tl.int64) * s_bt
        mask_row = MASK + r.to(tl.int64) * s_mr
        # a sliding window: positions relative to the first row (tree rows: root +
        # depth); no row sees context keys before ctx - window + 1
        base = 0
        qrel = qi
        if WINDOW:
            qrel = tree_depth(mask_row, s_mi, qi, row_ok, has, RP)
            if ctx - window + 1 > 0:
                base = ctx - window + 1
        # this split's keys: whole tiles, [k_lo, k_hi)
        per = (kend - base + BLOCK_N * S - 1) // (BLOCK_N * S) * BLOCK_N
        k_lo = base + sp * per
        k_hi = k_lo + per
        if kend < k_hi:
            k_hi = kend
        if TWO_LOOPS:  # context tiles without the tree mask, then this step's rows
            c_hi = k_hi
            if ctx < c_hi:
                c_hi = ctx
            t_lo = k_lo
            if t_lo < ctx:
                t_lo = ctx
            if USE_FOR:
                for start in range(k_lo, c_hi, BLOCK_N):
                    m_i, l_i, acc = _ctx_tile(start, m_i, l_i, acc, q, K, V, bt_row, row_ok,
                                              d, dm, c_hi, ctx, s_kb, s_kt, s_kh, s_vb, s_vt,
                                              s_vh, scale, kvh, block_size, qrel, window,
                                              BLOCK_N, IEEE, WINDOW)
                for start in range(t_lo, k_hi, BLOCK_N):
                    m_i, l_i, acc = _tile(start, m_i, l_i, acc, q, K, V, bt_row, mask_row,
                                          qi, row_ok, d, dm, ctx, k_hi, has, s_kb, s_kt, s_kh,
                                          s_vb, s_vt, s_vh, s_mi, scale, kvh, block_size,
                                          qrel, window, BLOCK_N, IEEE, RP, WINDOW)
            else:
                start = k_lo
                while start < c_hi:
                    m_i, l_i, acc = _ctx_tile(start, m_i, l_i, acc, q, K, V, bt_row, row_ok,
                                              d, dm, c_hi, ctx, s_kb, s_kt, s_kh, s_vb, s_vt,
                                              s_vh, scale, kvh, block_size, qrel, window,
                                              BLOCK_N, IEEE, WINDOW)
                    start += BLOCK_N
                start = t_lo
                while start < k_hi:
                    m_i, l_i, acc = _tile(start, m_i, l_i, acc, q, K, V, bt_row, mask_row,
                                          qi, row_ok, d, dm, ctx, k_hi, has, s_kb, s_kt, s_kh,
                                          s_vb, s_vt, s_vh, s_mi, scale, kvh, block_size,
                                          qrel, window, BLOCK_N, IEEE, RP, WINDOW)
                    start += BLOCK_N
        elif USE_FOR:  # compiled: a for loop (software-pipelined)
            for start in range(k_lo, k_hi, BLOCK_N):
                m_i, l_i, acc = _tile(start, m_i, l_i, acc, q, K, V, bt_row, mask_row, qi,
                                      row_ok, d, dm, ctx, k_hi, has, s_kb, s_kt, s_kh, s_vb,
                                      s_vt, s_vh, s_mi, scale, kvh, block_size, qrel, window,
                                      BLOCK_N, IEEE, RP, WINDOW)
        else:  # the CPU interpreter cannot take a loaded loop bound in range()
            start = k_lo
            while start < k_hi:
                m_i, l_i, acc = _tile(start, m_i, l_i, acc, q, K, V, bt_row, mask_row, qi,
                                      row_ok, d, dm, ctx, k_hi, has, s_kb, s_kt, s_kh, s_vb,
                                      s_vt, s_vh, s_mi, scale, kvh, block_size, qrel, window,
                                      BLOCK_N, IEEE, RP, WINDOW)
                start += BLOCK_N
        if S == 1:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_safe[:, None]
            tl.store(O + tok[:, None] * s_ot + h[:, None] * s_oh + d[None, :],
                     out.to(O.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
        else:
            grp = (r.to(tl.int64) * NQB + qb) * NKV + kvh
            part = grp * S + sp
            tl.store(PM + part * M + m, m_i)
            tl.store(PL + part * M + m, l_i)
            tl.store(PACC + (part * M + m)[:, None] * DP + d[None, :], acc)
            if FUSED:
                # every thread's stores, then one release/acquire count per program:
                # the S-th to arrive sees all S partial states and merges them
                tl.debug_barrier()
                arrived = tl.atomic_add(CNT + grp, 1)
                if arrived == S - 1:
                    tl.debug_barrier()
                    _merge_out(O, PM, PL, PACC, grp * S, m, d, tok, h, row_ok, dm, s_ot,
                               s_oh, M, DP, S, True, M)
                    tl.atomic_xchg(CNT + grp, 0)  # zero again: the next launch / replay

    @triton.jit
    def _combine(O, QSL, PM, PL, PACC, s_ot, s_oh, NQB, NKV,
                 G: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, S: tl.constexpr, MC: tl.constexpr):
        # one program merges MC of a query block's M rows (MC = M: the whole block)
        r = tl.program_id(0)
        qb = tl.program_id(1) // (M // MC)
        m = (tl.program_id(1) % (M // MC)) * MC + tl.arange(0, MC)
        kvh = tl.program_id(2)
        q0 = tl.load(QSL + r)
        q_len = tl.load(QSL + r + 1) - q0
        if qb * BLOCK_Q >= q_len:
            return
        qi, h, row_ok, d, dm, tok = rows_at(m, q0, q_len, qb, kvh, G, BLOCK_Q, D, DP)
        base = ((r.to(tl.int64) * NQB + qb) * NKV + kvh) * S
        _merge_out(O, PM, PL, PACC, base, m, d, tok, h, row_ok, dm, s_ot, s_oh, MC, DP, S,
                   False, M)

    @triton.jit
    def _merge_out(O, PM, PL, PACC, base, m, d, tok, h, row_ok, dm, s_ot, s_oh,
                   M: tl.constexpr, DP: tl.constexpr, S: tl.constexpr, CG: tl.constexpr,
                   MS: tl.constexpr):
        """Merge the S partial softmax states from ``base`` on and store the rows: M rows
        ``m`` of the MS a partial state holds (CG: the loads bypass L1, as in the fused
        form, where other programs wrote them)."""
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, DP], tl.float32)
        CACHE: tl.constexpr = ".cg" if CG else ""
        for sp in tl.static_range(S):
            ms = tl.load(PM + (base + sp) * MS + m, cache_modifier=CACHE)
            ls = tl.load(PL + (base + sp) * MS + m, cache_modifier=CACHE)
            accs = tl.load(PACC + ((base + sp) * MS + m)[:, None] * DP + d[None, :],
                           cache_modifier=CACHE)
            m_i, l_i, acc = merge_state(m_i, l_i, acc, ms, ls, accs)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(O + tok[:, None] * s_ot + h[:, None] * s_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


# (device, stream) -> its counter buffers, newest last
_counters: dict[tuple[str, int], list[torch.Tensor]] = {}


def counters(device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of >= n arrival counters (fused_combine) for the launches
    on ``device``'s current stream: one per stream (launches on a stream run one after
    another; two streams, e.g. vLLM's dual-batch overlap, get two), kept zero by the
    kernel itself (the last program of a group resets its counter), so CUDA graphs
    replay it as captured.  A bigger one replaces it; the smaller stays alive for the
    graphs captured with it."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    bufs = _counters.setdefault((str(device), stream), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


def launch(query, key_cache, value_cache, output, block_table, seq_lens, query_start_loc,
           has_tree, mask, scale: float, max_query_len: int, num_kv_heads: int,
           block_n: int | None = None, splits: int | None = None, block_q: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None,
           window: int | None = None, two_loops: bool | None = None,
           maxnreg: int | None = None, fused_combine: bool | None = None,
           combine_warps: int | None = None, combine_rows: int | None = None) -> torch.Tensor:
    """query/output [T, Hq, D] (or [T, Hq*D]); key/value_cache [blocks, block_size,
    Hkv, D]; block_table [R, max_blocks]; seq_lens [R]; query_start_loc [R + 1];
    has_tree [>= R] int32; mask [>= R, rows, rows] int8 (last dim contiguous);
    window: a sliding window W (a row sees keys at positions >= its own - W + 1);
    fused_combine: with key splits, the last split of each query block merges the
    partial states (no second launch; a zeroed counter per block, left zeroed);
    combine_warps: the warps of the separate merge kernel (default 4); combine_rows: the
    rows one merge program takes (a power of two <= the block's rows; default all).

    Small batches split the keys over S programs (flash-decoding style) so the GPU is
    filled; S depends on the launch shape only (CUDA-graph safe: each program derives
    its key range from the loaded sequence length)."""
    num_reqs = query_start_loc.shape[0] - 1
    d = key_cache.shape[-1]
    hq = query.shape[1] if query.dim() == 3 else query.shape[1] // d
    q = head_view(query, hq)
    o = head_view(output, hq)
    g = hq // num_kv_heads
    cfg = pick_config(num_reqs * max(int(max_query_len), 1))
    block_q = block_q or cfg.get("block_q") or max(1, 64 // g)
    block_n = block_n or cfg.get("block_n") or 64
    splits = splits or cfg.get("splits") or None
    num_warps = num_warps or cfg.get("num_warps") or 4
    num_stages = num_stages or cfg.get("num_stages")
    two_loops = cfg.get("two_loops", False) if two_loops is None else two_loops
    fused = cfg.get("fused_combine", False) if fused_combine is None else fused_combine
    extra = {} if num_stages is None else {"num_stages": num_stages}
    maxnreg = maxnreg or cfg.get("maxnreg")
    if maxnreg and not interpreting():  # a register cap: more programs per SM
        extra["maxnreg"] = maxnreg
    m = max(16, next_pow2(block_q * g))
    dp = max(16, next_pow2(d))
    nqb = triton.cdiv(max(int(max_query_len), 1), block_q)
    progs = num_reqs * nqb * num_kv_heads
    if splits is None:
        splits = 1 if progs >= SPLIT_MIN_PROGRAMS else \
            max(1, min(MAX_SPLITS, (2 * SPLIT_MIN_PROGRAMS) // max(progs, 1)))
    if splits > 1:
        n = progs * splits * m
        pm = torch.empty(n, dtype=torch.float32, device=q.device)
        pl = torch.empty(n, dtype=torch.float32, device=q.device)
        pacc = torch.empty(n * dp, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = q  # unused
    fused = bool(fused) and splits > 1
    cnt = counters(q.device, progs) if fused else seq_lens  # unused without
    assert mask.stride(2) == 1
    _tree_attn_kernel[(num_reqs, nqb, num_kv_heads * splits)](
        q, key_cache, value_cache, o, block_table, seq_lens, query_start_loc, has_tree, mask,
        pm, pl, pacc, cnt,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), mask.stride(0), mask.stride(1), float(scale),
        key_cache.shape[1], nqb, num_kv_heads, int(window or 0),
        G=g, BLOCK_Q=block_q, M=m, BLOCK_N=block_n, D=d, DP=dp,
        IEEE=query.dtype == torch.float32, USE_FOR=not interpreting(), S=splits,
        RP=max(2, next_pow2(mask.shape[2])), WINDOW=window is not None,
        TWO_LOOPS=bool(two_loops), FUSED=fused, num_warps=num_warps, **extra)
    if splits > 1 and not fused:
        mc = min(m, combine_rows or cfg.get("combine_rows") or m)
        _combine[(num_reqs, nqb * (m // mc), num_kv_heads)](
            o, query_start_loc, pm, pl, pacc, o.stride(0), o.stride(1), nqb, num_kv_heads,
            G=g, BLOCK_Q=block_q, M=m, D=d, DP=dp, S=splits, MC=mc,
            num_warps=combine_warps or cfg.get("combine_warps") or 4)
    return output


def split_kv(kv_cache: torch.Tensor, layout: str, head_size: int):
    """(key_cache, value_cache) as [num_blocks, block_size, kv_heads, head_size] views.

    "kv_outer": [2, blocks, block_size, heads, D] (vLLM 0.20.x FA / Flex);
    "heads_packed": [blocks, heads, block_size, 2 * D] (0.32/0.33 FA / Triton)."""
    if layout == "kv_outer":
        return kv_cache.unbind(0)
    if layout == "heads_packed":
        return kv_cache.transpose(1, 2).split(head_size, dim=-1)
    raise ValueError(f"unknown KV cache layout {layout!r}")


def tree_attention(impl, layer, query, key, value, kv_cache, md, output, backend="",
                   layout="kv_outer"):
    """The backends' forward for metadata marked by the DDTree runtime (``md.ddtree``
    is the runtime's TreeState).  K/V of this step are already in ``kv_cache``."""
    if not getattr(impl, "_ddtree_checked", False):
        check(impl)
        impl._ddtree_checked = True
    window = window_of(impl)
    state = md.ddtree
    key_cache, value_cache = split_kv(kv_cache, layout, impl.head_size)
    # key None: a layer sharing another's KV (the single kernel)
    if key is not None and value is not None and use_split(md, state.split):
        return _split(impl, query, key, value, key_cache, value_cache, md, output, state,
                      backend, window)
    return launch(query, key_cache, value_cache, output, md.block_table, md.seq_lens,
                  md.query_start_loc, state.has_tree, state.mask, impl.scale,
                  md.max_query_len, impl.num_kv_heads, window=window)


# Split tree attention (split.py): the context through the backend's FlashAttention
# (or our Triton prefix kernel), only the tree through Triton.  ddtree_split_attn:
# "auto" (default) splits batches of >= SPLIT_MIN_REQS requests, where it is much
# faster (H200: 1.13x FA3 vs 7.7x for the single kernel at 16 requests, context 4096);
# at batch 1 the single kernel is as fast.  "on": always, "off": never.
SPLIT_MIN_REQS = 4


def use_split(md, mode: str) -> bool:
    """Decided from the launch shape only (the batch's request count), so a captured
    CUDA graph always replays the path it was captured with."""
    if mode == "auto":
        return md.query_start_loc.shape[0] - 1 >= SPLIT_MIN_REQS
    return mode == "on"


def _split(impl, query, key, value, key_cache, value_cache, md, output, state, backend,
           window):
    from .split import context_lens, split_tree_attention

    ctx = getattr(md, "_ddtree_ctx", None)
    if ctx is None:  # once per step, shared by the layers of this metadata
        ctx = context_lens(md.seq_lens, md.query_start_loc)
        md._ddtree_ctx = ctx
    # FlashAttention's window counts from the last query row, not tree positions
    fa = backend == "flash_attn" and query.dtype != torch.float32 and window is None
    return split_tree_attention(
        query, key, value, key_cache, value_cache, output, md.block_table, md.seq_lens,
        md.query_start_loc, state.has_tree, state.mask, impl.scale, md.max_query_len,
        md.max_seq_len, impl.num_kv_heads, prefix="fa" if fa else "triton", ctx_lens=ctx,
        fa_version=getattr(impl, "vllm_flash_attn_version", None) or 3,
        num_splits=getattr(md, "max_num_splits", 0) or 0, sliding_window=window)
