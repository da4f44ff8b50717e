"""Split tree attention for a DDTree verify step: the committed context through the
backend's own kernel, only the tree through Triton, merged by log-sum-exp.

For request r with q_len = qsl[r+1] - qsl[r] query rows and ctx = seq_len - q_len
committed tokens, every query row sees all ctx context keys (non-causal), and among
this step's rows the ones ``cuda_attention`` describes (tree: ``mask[r, i, j]``;
``has_tree[r] == 0``: causal j <= i).  So

  prefix: out_p, lse_p = attention(q, context keys), no mask   -> FlashAttention
          (``flash_attn_varlen_func(causal=False, seqused_k=ctx, block_table,
          return_softmax_lse=True)``: what vLLM's cascade attention does), or our
          Triton paged kernel (backends without an LSE: FLEX_ATTENTION, TRITON_ATTN:
          ``unified_attention`` returns none);
  tree:   (B+1) x (B+1) keys per request, read from this step's ``key``/``value``
          tensors (rows aligned with ``query``), not from the paged cache;
  merge:  in the tree kernel's epilogue (one launch fewer than vLLM's
          ``merge_attn_states``; same convention: natural-log LSE [Hq, T], +inf
          (FA2's empty rows) read as -inf).

Contract of ``split_tree_attention`` (the entry point):
  query [T, Hq, D] (or [T, Hq*D]); key, value [T, Hkv, D]: this step's K/V, rows
  aligned with query (the backend's forward arguments); key_cache, value_cache
  [num_blocks, block_size, Hkv, D], any strides with a contiguous last dim (0.20.x:
  ``kv_cache.unbind(0)``; 0.32 FLASH_ATTN: ``kv_cache.transpose(1, 2).split(D, -1)``);
  output like query, written for rows < qsl[-1] (FA writes the prefix into it, the
  tree kernel reads it back and overwrites it: one buffer); block_table [R, max_blocks]
  int32; seq_lens [R] int32 (context + this step); query_start_loc [R + 1] int32;
  has_tree [>= R] int32; mask [>= R, rows, rows] int8, last dim contiguous (the
  ``TreeState`` buffers); GQA: Hq % Hkv == 0; fp32 / bf16 / fp16 (FA: bf16 / fp16
  only; fp32 needs prefix='triton'); scale = the softmax scale; a sliding window W
  (prefix='triton' only: every row sees keys at positions >= its own - W + 1, tree
  rows at root + depth).  Refused: softcap (NotImplementedError).  CUDA graphs: launches depend on shapes and host ints only
  (max_query_len, max_seq_len), every per-step value is read from tensors.
"""

from __future__ import annotations

import torch

from .tiles import head_view
from ..core._triton import HAS_TRITON, interpreting, next_pow2, tl, triton

SPLIT_MIN_PROGRAMS = 132  # H100/H200 SM count (as cuda_attention)
MAX_SPLITS = 8


def context_lens(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """[R] int32 committed tokens per request: seq_len - query length."""
    n = query_start_loc.shape[0] - 1
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    return (seq_lens[:n] - q_len).to(torch.int32)


# ------------------------------------------------------------------------ prefix


def prefix_fa(query, key_cache, value_cache, out, block_table, ctx_lens, query_start_loc,
              max_query_len, max_seq_len, scale, fa_version=3, num_splits=0):
    """FlashAttention over the committed context: writes the normalised prefix output
    into ``out``, returns its natural-log LSE [Hq, T] (float32)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as e:  # pragma: no cover - depends on the install
        raise NotImplementedError("split tree attention with prefix='fa' needs vLLM's "
                                  "flash attention (vllm.vllm_flash_attn); use "
                                  f"prefix='triton' ({e})") from e
    _, lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=query_start_loc,
        max_seqlen_q=max_query_len, seqused_k=ctx_lens, max_seqlen_k=max_seq_len,
        softmax_scale=scale, causal=False, block_table=block_table,
        return_softmax_lse=True, fa_version=fa_version, num_splits=num_splits)
    return lse


def prefix_torch(query, key_cache, value_cache, out, block_table, ctx_lens, query_start_loc,
                 max_query_len, max_seq_len, scale, num_kv_heads):
    """float64 torch stand-in for ``prefix_fa`` (same outputs and conventions, incl.
    out = 0 and lse = +inf for rows without context, like FA2)."""
    t, hq, d = out.shape
    lse = torch.full((hq, t), float("inf"), dtype=torch.float32, device=query.device)
    g = hq // num_kv_heads
    bs = key_cache.shape[1]
    qsl, ctx = query_start_loc.tolist(), ctx_lens.tolist()
    for r in range(len(qsl) - 1):
        q0, q1, c = qsl[r], qsl[r + 1], ctx[r]
        if q1 <= q0:
            continue
        if c == 0:
            out[q0:q1] = 0
            continue
        pos = torch.arange(c, device=query.device)
        blk = block_table[r, pos // bs].long()
        k = key_cache[blk, pos % bs].double().repeat_interleave(g, dim=1)
        v = value_cache[blk, pos % bs].double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", query[q0:q1].double(), k) * scale
        lse[:, q0:q1] = torch.logsumexp(s, -1).float()
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).to(out.dtype)
    return lse


# ------------------------------------------------------------------------ Triton

if HAS_TRITON:
    from .tiles import merge_state, online_update, query_rows, tile_scores, tree_depth

    @triton.jit
    def _prefix_tile(start, m_i, l_i, acc, q, KC, VC, bt_row, kend, d, dm, s_kb, s_kt, s_kh,
                     s_vb, s_vt, s_vh, kvh, block_size, scale, lo,
                     BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Context keys [start, start + BLOCK_N) below kend, each row from its lo[m] on
        (the sliding window's first key; 0 without one)."""
        kk = start + tl.arange(0, BLOCK_N)
        km = kk < kend
        blk = tl.load(bt_row + kk // block_size, mask=km, other=0).to(tl.int64)
        off = (kk % block_size).to(tl.int64)
        kvm = km[:, None] & dm[None, :]
        k = tl.load(KC + blk[:, None] * s_kb + off[:, None] * s_kt + kvh * s_kh + d[None, :],
                    mask=kvm, other=0.0)
        s = tl.where(km[None, :] & (kk[None, :] >= lo[:, None]), tile_scores(q, k, scale, IEEE),
                     float("-inf"))
        v = tl.load(VC + blk[:, None] * s_vb + off[:, None] * s_vt + kvh * s_vh + d[None, :],
                    mask=kvm, other=0.0)
        return online_update(s, m_i, l_i, acc, v, IEEE)

    @triton.jit
    def _prefix_kernel(Q, KC, VC, BT, CTX, QSL, O, PM, PL, PA, HAS, MASK,
                       s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_ot, s_oh,
                       s_ms, s_mh, s_mt, s_as, s_at, s_ah, s_mr, s_mi, scale, block_size,
                       window, G: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr,
                       BLOCK_N: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                       IEEE: tl.constexpr, USE_FOR: tl.constexpr, S: tl.constexpr,
                       RP: tl.constexpr, WINDOW: tl.constexpr):
        # one program = request x BLOCK_Q query tokens x KV head (its G query heads
        # packed in M rows) x one of S key ranges of the context.  S == 1: normalised
        # output into O and the LSE into PM (FA's convention); S > 1: partial states
        # (m, l, acc) into PM / PL / PA, folded in by the tree kernel
        r = tl.program_id(0)
        qb = tl.program_id(1)
        kvh = tl.program_id(2) // S
        sp = tl.program_id(2) % S
        q0 = tl.load(QSL + r)
        q_len = tl.load(QSL + r + 1) - q0
        if qb * BLOCK_Q >= q_len:
            return
        ctx = tl.load(CTX + r)
        qi, h, row_ok, d, dm, tok, q = query_rows(Q, q0, q_len, qb, kvh, s_qt, s_qh,
                                                   G, BLOCK_Q, M, D, DP)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, DP], tl.float32)
        bt_row = BT + r.to(tl.int64) * s_bt
        # a sliding window: row m sees context keys from ctx + its relative position
        # (tree rows: depth) - window + 1 on; none sees keys before ctx - window + 1
        base = 0
        lo = tl.zeros([M], tl.int32)
        if WINDOW:
            has = tl.load(HAS + r) != 0
            rel = tree_depth(MASK + r.to(tl.int64) * s_mr, s_mi, qi, row_ok, has, RP)
            lo = ctx + rel - window + 1
            if ctx - window + 1 > 0:
                base = ctx - window + 1
        per = (ctx - base + BLOCK_N * S - 1) // (BLOCK_N * S) * BLOCK_N
        k_lo = base + sp * per
        k_hi = k_lo + per
        if ctx < k_hi:
            k_hi = ctx
        if USE_FOR:
            for start in range(k_lo, k_hi, BLOCK_N):
                m_i, l_i, acc = _prefix_tile(start, m_i, l_i, acc, q, KC, VC, bt_row, k_hi, d,
                                             dm, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, kvh,
                                             block_size, scale, lo, BLOCK_N, IEEE)
        else:  # the CPU interpreter cannot take a loaded loop bound in range()
            start = k_lo
            while start < k_hi:
                m_i, l_i, acc = _prefix_tile(start, m_i, l_i, acc, q, KC, VC, bt_row, k_hi, d,
                                             dm, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, kvh,
                                             block_size, scale, lo, BLOCK_N, IEEE)
                start += BLOCK_N
        om = row_ok[:, None] & dm[None, :]
        if S == 1:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(O + tok[:, None] * s_ot + h[:, None] * s_oh + d[None, :],
                     (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=om)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
            tl.store(PM + h * s_mh + tok * s_mt, lse, mask=row_ok)
        else:
            tl.store(PM + sp * s_ms + h * s_mh + tok * s_mt, m_i, mask=row_ok)
            tl.store(PL + sp * s_ms + h * s_mh + tok * s_mt, l_i, mask=row_ok)
            tl.store(PA + sp * s_as + tok[:, None] * s_at + h[:, None] * s_ah + d[None, :],
                     acc, mask=om)

    @triton.jit
    def _tree_tile(start, m_i, l_i, acc, q, K, V, q0, qi, row_ok, kend, has, mask_row, d, dm,
                   s_kt, s_kh, s_vt, s_vh, s_mi, kvh, scale, qrel, window,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, RP: tl.constexpr,
                   WINDOW: tl.constexpr):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < kend
        kt = (q0 + j).to(tl.int64)
        kvm = jm[:, None] & dm[None, :]
        k = tl.load(K + kt[:, None] * s_kt + kvh * s_kh + d[None, :], mask=kvm, other=0.0)
        s = tile_scores(q, k, scale, IEEE)
        tm = tl.load(mask_row + qi[:, None] * s_mi + j[None, :],
                     mask=row_ok[:, None] & jm[None, :] & has, other=0)
        vis = tl.where(has, tm != 0, j[None, :] <= qi[:, None])
        vis = vis & jm[None, :] & row_ok[:, None]
        if WINDOW:
            krel = tree_depth(mask_row, s_mi, j, jm, has, RP)
            vis = vis & (krel[None, :] > qrel[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        v = tl.load(V + kt[:, None] * s_vt + kvh * s_vh + d[None, :], mask=kvm, other=0.0)
        return online_update(s, m_i, l_i, acc, v, IEEE)

    @triton.jit
    def _tree_kernel(Q, K, V, O, QSL, HAS, MASK, PM, PL, PA,
                     s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_mr, s_mi,
                     s_ms, s_mh, s_mt, s_as, s_at, s_ah, scale, window,
                     G: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr,
                     BLOCK_N: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     IEEE: tl.constexpr, USE_FOR: tl.constexpr, S: tl.constexpr,
                     RP: tl.constexpr, WINDOW: tl.constexpr):
        # one program = request x BLOCK_Q query tokens x KV head: attention over this
        # step's rows under the tree (or causal) mask, then the prefix folded in:
        # S == 0: (normalised output in PA, LSE in PM) as FA writes them; S >= 1:
        # S partial states.  Ancestors precede their node, so keys stop at the block's
        # last row.
        r = tl.program_id(0)
        qb = tl.program_id(1)
        kvh = tl.program_id(2)
        q0 = tl.load(QSL + r)
        q_len = tl.load(QSL + r + 1) - q0
        if qb * BLOCK_Q >= q_len:
            return
        qi, h, row_ok, d, dm, tok, q = query_rows(Q, q0, q_len, qb, kvh, s_qt, s_qh,
                                                   G, BLOCK_Q, M, D, DP)
        has = tl.load(HAS + r) != 0
        mask_row = MASK + r.to(tl.int64) * s_mr
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, DP], tl.float32)
        kend = q_len
        if (qb + 1) * BLOCK_Q < q_len:
            kend = (qb + 1) * BLOCK_Q
        qrel = qi
        if WINDOW:
            qrel = tree_depth(mask_row, s_mi, qi, row_ok, has, RP)
        if USE_FOR:
            for start in range(0, kend, BLOCK_N):
                m_i, l_i, acc = _tree_tile(start, m_i, l_i, acc, q, K, V, q0, qi, row_ok, kend,
                                           has, mask_row, d, dm, s_kt, s_kh, s_vt, s_vh, s_mi,
                                           kvh, scale, qrel, window, BLOCK_N, IEEE, RP, WINDOW)
        else:
            start = 0
            while start < kend:
                m_i, l_i, acc = _tree_tile(start, m_i, l_i, acc, q, K, V, q0, qi, row_ok, kend,
                                           has, mask_row, d, dm, s_kt, s_kh, s_vt, s_vh, s_mi,
                                           kvh, scale, qrel, window, BLOCK_N, IEEE, RP, WINDOW)
                start += BLOCK_N
        om = row_ok[:, None] & dm[None, :]
        if S == 0:
            pm = tl.load(PM + h * s_mh + tok * s_mt, mask=row_ok, other=float("-inf"))
            pm = tl.where(pm == float("inf"), float("-inf"), pm)  # FA2: rows without keys
            pa = tl.load(PA + tok[:, None] * s_at + h[:, None] * s_ah + d[None, :], mask=om,
                         other=0.0).to(tl.float32)
            m_i, l_i, acc = merge_state(m_i, l_i, acc, pm, tl.where(pm == float("-inf"), 0.0, 1.0),
                                   tl.where((pm == float("-inf"))[:, None], 0.0, pa))
        else:
            for sp in tl.static_range(S):
                pm = tl.load(PM + sp * s_ms + h * s_mh + tok * s_mt, mask=row_ok,
                             other=float("-inf"))
                pl = tl.load(PL + sp * s_ms + h * s_mh + tok * s_mt, mask=row_ok, other=0.0)
                pa = tl.load(PA + sp * s_as + tok[:, None] * s_at + h[:, None] * s_ah + d[None, :],
                             mask=om, other=0.0)
                m_i, l_i, acc = merge_state(m_i, l_i, acc, pm, pl, pa)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(O + tok[:, None] * s_ot + h[:, None] * s_oh + d[None, :],
                 (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=om)


class _Grid:
    """Launch shape shared by both kernels: requests x query blocks x KV heads, with
    BLOCK_Q query tokens of the G heads of one KV head packed in M rows."""

    def __init__(self, query_start_loc, out, num_kv_heads, max_query_len, block_q):
        self.num_reqs = query_start_loc.shape[0] - 1
        self.t, hq, self.d = out.shape
        self.g = hq // num_kv_heads
        self.bq = block_q or max(1, 64 // self.g)
        self.m = max(16, next_pow2(self.bq * self.g))
        self.dp = max(16, next_pow2(self.d))
        self.nqb = triton.cdiv(max(int(max_query_len), 1), self.bq)

    def consts(self, query, block_n):
        return dict(G=self.g, BLOCK_Q=self.bq, M=self.m, BLOCK_N=block_n, D=self.d, DP=self.dp,
                    IEEE=query.dtype == torch.float32, USE_FOR=not interpreting())


def prefix_triton(query, key_cache, value_cache, out, block_table, ctx_lens, query_start_loc,
                  max_query_len, num_kv_heads, scale, splits=None, block_q=None, block_n=64,
                  num_warps=4, window=None, has_tree=None, mask=None):
    """Our paged prefix kernel (window: a sliding window, rows at their tree positions
    from ``has_tree`` / ``mask``).  Returns the prefix state for ``tree_part``:
    (0, lse [Hq, T], out) with the normalised output written into ``out`` when it runs
    unsplit, else (S, (m, l) [S, Hq, T], acc [S, T, Hq, D]) partial states."""
    gr = _Grid(query_start_loc, out, num_kv_heads, max_query_len, block_q)
    t, hq, dp = gr.t, out.shape[1], gr.dp
    progs = gr.num_reqs * gr.nqb * num_kv_heads
    if splits is None:
        splits = 1 if progs >= SPLIT_MIN_PROGRAMS else \
            max(1, min(MAX_SPLITS, (2 * SPLIT_MIN_PROGRAMS) // max(progs, 1)))
    dev = query.device
    f32 = dict(device=dev, dtype=torch.float32)
    if splits == 1:
        pm = torch.empty(hq, t, **f32)
        pl, pa = pm, out
        sm = (0, pm.stride(0), pm.stride(1))
        sa = (0, 0, 0)
    else:
        pm = torch.empty(splits, hq, t, **f32)
        pl = torch.empty(splits, hq, t, **f32)
        pa = torch.empty(splits, t, hq, dp, **f32)
        sm = pm.stride()
        sa = pa.stride()[:3]
    if window is None:
        has_tree = mask = ctx_lens  # not read
        sr, rp = (0, 0), 2
    else:
        assert mask.stride(2) == 1
        sr, rp = (mask.stride(0), mask.stride(1)), max(2, next_pow2(mask.shape[2]))
    _prefix_kernel[(gr.num_reqs, gr.nqb, num_kv_heads * splits)](
        query, key_cache, value_cache, block_table, ctx_lens, query_start_loc, out, pm, pl, pa,
        has_tree, mask, query.stride(0), query.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
        value_cache.stride(2), block_table.stride(0), out.stride(0), out.stride(1), *sm, *sa,
        *sr, float(scale), key_cache.shape[1], int(window or 0),
        **gr.consts(query, block_n), S=splits, RP=rp, WINDOW=window is not None,
        num_warps=num_warps)
    if splits == 1:
        return 0, pm, out
    return splits, (pm, pl), pa


def tree_part(query, key, value, output, query_start_loc, has_tree, mask, scale,
              max_query_len, num_kv_heads, prefix_state, block_q=None, block_n=32,
              num_warps=4, window=None):
    """The tree part + the merge: writes the final attention into ``output``.
    prefix_state: (0, lse [Hq, T], out_p [T, Hq, D]) as FA returns it (out_p may be
    ``output`` itself), or (S, (m, l) [S, Hq, T], acc [S, T, Hq, D]) partials."""
    gr = _Grid(query_start_loc, output, num_kv_heads, max_query_len, block_q)
    s, pm, pa = prefix_state
    if s == 0:
        pl = pm
        sm = (0, pm.stride(0), pm.stride(1))
    else:
        pm, pl = pm
        sm = pm.stride()
    sa = (pa.stride(0), pa.stride(1), pa.stride(2)) if s else (0, pa.stride(0), pa.stride(1))
    assert mask.stride(2) == 1
    _tree_kernel[(gr.num_reqs, gr.nqb, num_kv_heads)](
        query, key, value, output, query_start_loc, has_tree, mask, pm, pl, pa,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), output.stride(0), output.stride(1), mask.stride(0), mask.stride(1),
        *sm, *sa, float(scale), int(window or 0), **gr.consts(query, block_n), S=s,
        RP=max(2, next_pow2(mask.shape[2])), WINDOW=window is not None, num_warps=num_warps)
    return output


def split_tree_attention(query, key, value, key_cache, value_cache, output, block_table,
                         seq_lens, query_start_loc, has_tree, mask, scale, max_query_len,
                         max_seq_len, num_kv_heads, prefix="fa", ctx_lens=None,
                         fa_version=3, num_splits=0, sliding_window=None, softcap=0.0,
                         prefix_splits=None, tree_kw=None):
    """Tree attention of a verify step = prefix (FA or Triton) + tree part + merge.

    See the module docstring for the layouts.  prefix: 'fa' (vllm_flash_attn, bf16 /
    fp16), 'triton' (our kernel, any dtype), or a callable with ``prefix_torch``'s
    signature minus num_kv_heads (tests).  ctx_lens: [R] int32 context lengths if the
    caller keeps them (computed once per step instead of per layer); fa_version /
    num_splits: the backend's (``impl.vllm_flash_attn_version``,
    ``attn_metadata.max_num_splits``); prefix_splits: key splits of the Triton prefix
    (None: by program count); tree_kw: the tree kernel's block_q / block_n / num_warps.
    Returns output.
    """
    if sliding_window is not None and prefix != "triton":
        raise NotImplementedError("split tree attention with a sliding window needs "
                                  "prefix='triton' (FlashAttention's window counts from "
                                  "the last query row, not from tree positions)")
    if softcap:
        raise NotImplementedError("split tree attention: softcap is not supported")
    hq = query.shape[1] if query.dim() == 3 else query.shape[1] // key_cache.shape[-1]
    q = head_view(query, hq)
    o = head_view(output, hq)
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {num_kv_heads} KV heads")
    ctx = context_lens(seq_lens, query_start_loc) if ctx_lens is None else ctx_lens
    args = (q, key_cache, value_cache, o, block_table, ctx, query_start_loc, max_query_len)
    if prefix == "triton":
        state = prefix_triton(*args, num_kv_heads, scale, splits=prefix_splits,
                              window=sliding_window, has_tree=has_tree, mask=mask)
    elif prefix == "fa":
        state = (0, prefix_fa(*args, max_seq_len, scale, fa_version, num_splits), o)
    else:
        state = (0, prefix(*args, max_seq_len, scale), o)
    return tree_part(q, key, value, o, query_start_loc, has_tree, mask, scale, max_query_len,
                     num_kv_heads, state, window=sliding_window, **(tree_kw or {}))
