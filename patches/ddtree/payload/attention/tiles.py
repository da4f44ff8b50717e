"""Triton building blocks shared by the tree-attention kernels (cuda_attention.py: the
single kernel; split_attention.py: prefix + tree part): a program's query rows, the
scores of a key tile, the online-softmax update and the fold of a partial state."""

from __future__ import annotations

import torch

from ..core._triton import HAS_TRITON, tl, triton


def head_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.dim() == 3 else x.view(x.shape[0], heads, -1)


if HAS_TRITON:

    @triton.jit
    def online_update(s, m_i, l_i, acc, v, IEEE: tl.constexpr):
        """Online-softmax step with scores s [M, N] (masked = -inf) and values v [N, D]."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def merge_state(m_i, l_i, acc, pm, pl, pa):
        """Fold a partial softmax state (max pm, sum pl, unnormalised acc pa) in."""
        m_new = tl.maximum(m_i, pm)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m_i - m_safe)
        b = tl.exp(pm - m_safe)
        return m_new, l_i * a + pl * b, acc * a[:, None] + pa * b[:, None]

    @triton.jit
    def tile_scores(q, k, scale, IEEE: tl.constexpr):
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        return s * scale

    @triton.jit
    def tree_depth(mask_row, s_mi, rows, ok, has, RP: tl.constexpr):
        """Positions of a request's verify rows relative to its first one: a tree row's
        depth (its ancestors in the tree mask: they precede it), else the row index."""
        c = tl.arange(0, RP)
        mm = tl.load(mask_row + rows[:, None] * s_mi + c[None, :],
                     mask=ok[:, None] & (c[None, :] <= rows[:, None]) & has, other=0)
        return tl.where(has, tl.sum((mm != 0).to(tl.int32), 1) - 1, rows)

    @triton.jit
    def row_index(q0, q_len, qb, kvh, G: tl.constexpr, BLOCK_Q: tl.constexpr,
                  M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """A program's M rows: BLOCK_Q query tokens x the G query heads of KV head kvh
        (GQA packed like unified_attention): token index qi, head h, validity, the
        head-dim lanes, the token rows."""
        return rows_at(tl.arange(0, M), q0, q_len, qb, kvh, G, BLOCK_Q, D, DP)

    @triton.jit
    def rows_at(m, q0, q_len, qb, kvh, G: tl.constexpr, BLOCK_Q: tl.constexpr,
                D: tl.constexpr, DP: tl.constexpr):
        """row_index for the rows ``m`` of a block (a slice of them: the merge kernel)."""
        qi = qb * BLOCK_Q + m // G
        h = kvh * G + m % G
        row_ok = (m < BLOCK_Q * G) & (qi < q_len)
        d = tl.arange(0, DP)
        dm = d < D
        tok = (q0 + qi).to(tl.int64)
        return qi, h, row_ok, d, dm, tok

    @triton.jit
    def query_rows(Q, q0, q_len, qb, kvh, s_qt, s_qh, G: tl.constexpr, BLOCK_Q: tl.constexpr,
                    M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """row_index and the query tile of those rows."""
        qi, h, row_ok, d, dm, tok = row_index(q0, q_len, qb, kvh, G, BLOCK_Q, M, D, DP)
        q = tl.load(Q + tok[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                    mask=row_ok[:, None] & dm[None, :], other=0.0)
        return qi, h, row_ok, d, dm, tok, q
