"""The paired counts of one tree step in one Triton launch (the tree-vs-chain choice's
worker half, sched/paired.py): per request row, the tree's accepted drafts, the
chain's on the same step (the common prefix of the drafter's top-1 chain and the
walk's output, then the drafter's expected run where the tree left the chain's next
node out), their squares and product, and each smaller tree's accepted drafts; summed
over the valid rows into one row of the sums.  ``add_rows`` launches the kernel on CUDA
(or the Triton interpreter) and runs ``add_rows_torch``, its reference, elsewhere.
``keep_top1`` keeps a tree draft's top-1 chain and its log-probabilities by slot, also
in one launch.  The torch paths are about 40 small kernels a tree step, the kernels
two (the choice's tree step cost 0.13 ms more than the fixed tree's at 1 request, 8B
shape, H100, bench/RESULTS.md realpair_h100_2: these launches may be why; not
profiled).  Tested against the references in the Triton interpreter; not yet run on a
GPU (sched/paired.py falls back to the references if a kernel fails to launch).

Columns of ``sums`` (one row per batch size): tree accepted, rows, chain accepted,
rows, tree^2, chain^2, tree x chain, the rows' squared weights, then one per subtree.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, next_pow2, tl, triton
from .step import use_fused

COLS = 8  # columns before the subtrees'


if HAS_TRITON:

    @triton.jit
    def _paired_kernel(SUMS, s_sum, n, SLOTS, TOP1, s_top, LOGP, s_lp, OUT, s_out, s_o1, w,
                       ACC, VALID, PATH, s_path, s_p1, P, SUBS, C: tl.constexpr, BC: tl.constexpr,
                       S: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr,
                       BN: tl.constexpr):
        # one program, the rows as a block dimension (BN >= n), summed at the end
        r = tl.arange(0, BN)
        j = tl.arange(0, BC)
        rm = r < n
        slot = tl.load(SLOTS + r, mask=rm, other=0).to(tl.int64)
        a = tl.load(ACC + r, mask=rm, other=0).to(tl.int32)
        v = tl.load(VALID + r, mask=rm, other=0).to(tl.float32)
        m2 = rm[:, None] & (j[None, :] < w)
        t1 = tl.load(TOP1 + slot[:, None] * s_top + j[None, :], mask=m2, other=-1)
        o = tl.load(OUT + r[:, None] * s_out + j[None, :] * s_o1, mask=m2, other=-2)
        hit = (t1 == o) & (j[None, :] <= a[:, None]) & m2
        # leading hits: the first miss (columns >= w never hit)
        lead = tl.min(tl.where(hit, BC, j[None, :]), axis=1)
        start = a + 1
        lp = tl.load(LOGP + slot[:, None] * s_lp + j[None, :],
                     mask=rm[:, None] & (j[None, :] < C), other=0.0)
        cum = tl.cumsum(lp, axis=1)
        at = tl.minimum(a, C - 1)
        base = tl.sum(tl.where(j[None, :] == at[:, None], cum, 0.0), axis=1)
        later = (j[None, :] >= start[:, None]) & (j[None, :] < C)
        rest = tl.sum(tl.where(later, tl.exp(cum - base[:, None]), 0.0), axis=1)
        cut = (lead == start) & (start < C)
        ch = lead.to(tl.float32) + tl.where(cut, rest, 0.0)
        t = a.to(tl.float32)
        rows = tl.sum(v, axis=0)
        out = SUMS + n * s_sum
        tl.store(out + 0, tl.load(out + 0) + tl.sum(v * t, axis=0))
        tl.store(out + 1, tl.load(out + 1) + rows)
        tl.store(out + 2, tl.load(out + 2) + tl.sum(v * ch, axis=0))
        tl.store(out + 3, tl.load(out + 3) + rows)
        tl.store(out + 4, tl.load(out + 4) + tl.sum(v * t * t, axis=0))
        tl.store(out + 5, tl.load(out + 5) + tl.sum(v * ch * ch, axis=0))
        tl.store(out + 6, tl.load(out + 6) + tl.sum(v * t * ch, axis=0))
        tl.store(out + 7, tl.load(out + 7) + rows)
        if S > 0:  # each subtree: the path's leading rows inside it (row r = node r - 1)
            q = tl.arange(0, BS)
            p = tl.arange(0, BP)
            subs = tl.load(SUBS + q, mask=q < S, other=0)
            path = tl.load(PATH + r[:, None] * s_path + (1 + p[None, :]) * s_p1,
                           mask=rm[:, None] & (p[None, :] < P), other=-1)
            inside = (path[:, None, :] > 0) & (path[:, None, :] <= subs[None, :, None])
            first = tl.min(tl.where(inside, BP, p[None, None, :]), axis=2)
            got = tl.sum(v[:, None] * first.to(tl.float32), axis=0)
            old = tl.load(out + 8 + q, mask=q < S, other=0.0)
            tl.store(out + 8 + q, old + got, mask=q < S)


    @triton.jit
    def _top1_kernel(VALS, s_v0, s_v1, IDX, s_i0, s_i1, LSE, s_l0, s_l1, SLOTS, n, TOP1,
                     s_top,
                     LOGP, s_lp, C: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr):
        r = tl.arange(0, BN)
        j = tl.arange(0, BC)
        rm = r < n
        m2 = rm[:, None] & (j[None, :] < C)
        slot = tl.load(SLOTS + r, mask=rm, other=0).to(tl.int64)
        ids = tl.load(IDX + r[:, None] * s_i0 + j[None, :] * s_i1, mask=m2, other=0)
        v = tl.load(VALS + r[:, None] * s_v0 + j[None, :] * s_v1, mask=m2, other=0.0)
        lse = tl.load(LSE + r[:, None] * s_l0 + j[None, :] * s_l1, mask=m2, other=0.0)
        lp = (v - lse).to(tl.float32)  # in the inputs' dtype first, as torch does
        # not finite (a masked vocabulary: -inf, or nan) counts as never
        finite = (lp == lp) & (tl.abs(lp) <= 3.4028234663852886e38)
        lp = tl.where(finite, tl.minimum(lp, 0.0), -1e4)
        tl.store(TOP1 + slot[:, None] * s_top + j[None, :], ids, mask=m2)
        tl.store(LOGP + slot[:, None] * s_lp + j[None, :], lp, mask=m2)


def keep_top1(vals, idx, lse, slots, top1, logp, chain: int, fused=None) -> None:
    """A tree draft (kept top-K logits and ids [n, L, K] in key order: column 0 is each
    position's top-1; lse [n, L]; fp32, as v2/speculator.py keeps them): its top-1
    chain and the chain's log-probabilities (clamped to <= 0; -1e4 where not finite)
    into top1 / logp [*, >= chain] (contiguous rows) by request-state slot."""
    n = int(slots.shape[0])
    if not (use_fused(top1.device) if fused is None else fused):
        return keep_top1_torch(vals, idx, lse, slots, top1, logp, chain)
    v, i = vals[:, :, 0], idx[:, :, 0]
    _top1_kernel[(1,)](v, v.stride(0), v.stride(1), i, i.stride(0), i.stride(1), lse,
                       lse.stride(0), lse.stride(1), slots, n, top1, top1.stride(0), logp,
                       logp.stride(0), C=chain, BC=next_pow2(max(chain, 1)),
                       BN=next_pow2(max(n, 1)), num_warps=1 if n <= 32 else 4)


def keep_top1_torch(vals, idx, lse, slots, top1, logp, chain: int) -> None:
    """Reference of _top1_kernel."""
    c = chain
    top1[slots] = idx[:, :c, 0]
    lp = (vals[:, :c, 0] - lse[:, :c]).float()
    logp[slots] = torch.where(torch.isfinite(lp), lp.clamp(max=0.0), -1e4)


def add_rows(sums, n: int, slots, top1, logp, chain: int, output_tokens, num_accepted,
             valid, accepted_rows=None, subs=None, fused=None) -> None:
    """sums[n] += the paired counts of a tree step of n requests (see the module doc):
    slots [n] (request-state slots of top1 / logp [*, >= chain]), output_tokens [n, >= 1]
    (the accepted drafts then the bonus, -1 after), num_accepted [n], valid [n] (rows
    that had a tree), accepted_rows [n, L + 1] and subs [S] (subtree sizes) when S > 0;
    fused: the kernel (default: use_fused) or the reference."""
    n_subs = 0 if subs is None else int(subs.numel())
    if not (use_fused(sums.device) if fused is None else fused):
        return add_rows_torch(sums, n, slots, top1, logp, chain, output_tokens,
                              num_accepted, valid, accepted_rows, subs)
    w = min(output_tokens.shape[1], chain)
    path = accepted_rows if n_subs else output_tokens  # unread without subtrees
    p_len = accepted_rows.shape[1] - 1 if n_subs else 1
    _paired_kernel[(1,)](
        sums, sums.stride(0), n, slots, top1, top1.stride(0), logp, logp.stride(0),
        output_tokens, output_tokens.stride(0), output_tokens.stride(1), w, num_accepted,
        valid, path, path.stride(0), path.stride(1), p_len,
        subs if n_subs else slots, C=chain, BC=next_pow2(max(chain, 1)), S=n_subs,
        BS=next_pow2(max(n_subs, 1)), BP=next_pow2(max(p_len, 1)),
        BN=next_pow2(max(n, 1)), num_warps=1 if n <= 32 else 4)


def add_rows_torch(sums, n: int, slots, top1, logp, chain: int, output_tokens,
                   num_accepted, valid, accepted_rows=None, subs=None) -> None:
    """Reference of _paired_kernel."""
    out = output_tokens[:n]
    acc = num_accepted[:n].long()
    w = min(out.shape[1], chain)
    pos = torch.arange(chain, device=sums.device)
    # the target's tokens at positions 0 .. acc are known (the path, then the bonus)
    hit = (top1[slots][:, :w] == out[:, :w]) & (pos[:w].unsqueeze(0) <= acc.unsqueeze(1))
    chain_acc = hit.long().cumprod(1).sum(1).float()
    # a chain that matched every known token (the tree left out its next node) goes on
    # past the bonus with the drafter's own probabilities: + sum over d > acc of
    # prod_{acc < j <= d} p_j
    start = acc + 1
    cut = (chain_acc == start.float()) & (start < chain)
    cum = logp[slots][:, :chain].cumsum(1)
    base = cum.gather(1, acc.clamp(max=chain - 1).unsqueeze(1))
    later = pos.unsqueeze(0) >= start.unsqueeze(1)
    rest = (torch.exp(cum - base) * later).sum(1)
    chain_acc = chain_acc + torch.where(cut, rest, 0.0)
    one, t = torch.ones_like(chain_acc), acc.float()
    per_row = [t, one, chain_acc, one, t * t, chain_acc * chain_acc, t * chain_acc, one]
    if subs is not None and subs.numel():  # all sizes at once: [S, n] accepted inside
        path = accepted_rows[:n, 1:].unsqueeze(0)  # verify row r = node r - 1
        inside = (path > 0) & (path <= subs.view(-1, 1, 1))
        per_row.extend(inside.long().cumprod(2).sum(2).float().unbind(0))
    # rows without a tree add nothing: one product sums every column
    sums[n].add_(valid[:n].to(torch.float32) @ torch.stack(per_row, 1))
