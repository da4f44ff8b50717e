"""KV compaction after a tree walk: move the accepted path's KV to consecutive slots.

The verify step wrote row r's K/V at position start + r (start = position of the
root row = context length before the step).  After the walk, accepted node j
(row accepted_rows[n, j], j = 1..num_accepted[n]) must sit at position start + j.
Rows on a path increase strictly (parents precede children), so
accepted_rows[n, j] >= j.  A source can be a later entry's destination (rows
0, 2, 3: position 2 is read by j = 1 and written by j = 2), so both
implementations read every source before writing any destination: the kernel
loads an [L, block] tile, hits a barrier, then stores; the torch reference
gathers, then scatters.

Layouts (per-layer tensor; any strides, e.g. vLLM's HND/NHD stride orders):
  "kv_in_block"  [num_blocks, 2, block_size, kv_heads, head_dim]
  "kv_outer"     [2, num_blocks, block_size, kv_heads, head_dim]
  "heads_packed" [num_blocks, kv_heads, block_size, 2 * head_dim]  (K | V on the
                 last dim: vLLM 0.32.0's logical shape for FlashAttention, Triton,
                 FlexAttention and CPU attention)
"""

import torch

from ._triton import HAS_TRITON, next_pow2, tl, triton, use_triton

LAYOUTS = ("kv_in_block", "kv_outer", "heads_packed")


def token_view(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """View [num_blocks, block_size, A, B, C]: all K/V elements of one slot."""
    if layout == "kv_in_block":
        return kv.permute(0, 2, 1, 3, 4)
    if layout == "kv_outer":
        return kv.permute(1, 2, 0, 3, 4)
    if layout == "heads_packed":
        return kv.permute(0, 2, 1, 3).unsqueeze(2)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def compaction_slots(block_table, block_size: int, start_positions, accepted_rows, num_accepted):
    """(src_slots, dst_slots) [N, L] int64 for j = 1..L; -1 where nothing moves
    (j > num_accepted, or the row is already in place).  slot = block * block_size + offset."""
    n, l1 = accepted_rows.shape
    dev = accepted_rows.device
    j = torch.arange(1, l1, device=dev).unsqueeze(0)
    rows = accepted_rows[:, 1:].long()
    move = (j <= num_accepted.long().unsqueeze(1)) & (rows != j) & (rows >= 0)
    start = start_positions.long().unsqueeze(1)

    def slot(pos):
        blk = block_table.long().gather(1, (pos // block_size).clamp(max=block_table.shape[1] - 1))
        return blk * block_size + pos % block_size

    src = torch.where(move, slot(start + rows.clamp(min=0)), -1)
    dst = torch.where(move, slot(start + j.expand(n, -1)), -1)
    return src, dst


def compact_kv_slots_torch(kv_caches, src, dst, block_size: int, layout: str, noop_slot=None):
    """Reference: per layer, gather every source slot, then scatter (overlap-safe).

    Skipped entries (-1) become a self-copy of noop_slot[n] (the request's root
    slot: neither a source nor a destination), which keeps it free of host syncs;
    without noop_slot they are dropped with nonzero() (host sync)."""
    if noop_slot is not None:
        ns = noop_slot.long().unsqueeze(1).expand_as(src)
        s = torch.where(src >= 0, src, ns).reshape(-1)
        d = torch.where(src >= 0, dst, ns).reshape(-1)
    else:
        keep = torch.nonzero(src.reshape(-1) >= 0).squeeze(1)
        s, d = src.reshape(-1)[keep], dst.reshape(-1)[keep]
    for kv in kv_caches:
        tv = token_view(kv, layout)
        vals = tv[s // block_size, s % block_size]
        tv[d // block_size, d % block_size] = vals
    return kv_caches


if HAS_TRITON:

    @triton.jit
    def _compact_kernel(base_ptr, loff_ptr, src_ptr, dst_ptr, bt_ptr, s_bt, start_ptr, rows_ptr, s_rows,
                        nacc_ptr, s_blk, s_tok, s_a, s_b, s_c, NB, NC, INNER, block_size,
                        L: tl.constexpr, LP: tl.constexpr, BLOCK: tl.constexpr, FROM_ROWS: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        lay = tl.program_id(1)
        e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        em = e < INNER
        a = e // (NB * NC)
        b = (e // NC) % NB
        c = e % NC
        inner = a.to(tl.int64) * s_a + b.to(tl.int64) * s_b + c.to(tl.int64) * s_c
        base = base_ptr + tl.load(loff_ptr + lay)
        jj = tl.arange(0, LP)
        jm = jj < L
        if FROM_ROWS:  # compaction_slots, fused: slots from the block table
            j = (jj + 1).to(tl.int64)
            rows = tl.load(rows_ptr + n * s_rows + j, mask=jm, other=-1).to(tl.int64)
            nacc = tl.load(nacc_ptr + n).to(tl.int64)
            start = tl.load(start_ptr + n).to(tl.int64)
            move = jm & (j <= nacc) & (rows != j) & (rows >= 0)
            ps = start + tl.maximum(rows, 0)
            pd = start + j
            bs_ = tl.load(bt_ptr + n * s_bt + ps // block_size, mask=move, other=0).to(tl.int64)
            bd_ = tl.load(bt_ptr + n * s_bt + pd // block_size, mask=move, other=0).to(tl.int64)
            src = tl.where(move, bs_ * block_size + ps % block_size, -1)
            dst = tl.where(move, bd_ * block_size + pd % block_size, -1)
        else:
            src = tl.load(src_ptr + n * L + jj, mask=jm, other=-1)
            dst = tl.load(dst_ptr + n * L + jj, mask=jm, other=-1)
        ok = (src >= 0)[:, None] & em[None, :]
        so = (src // block_size) * s_blk + (src % block_size) * s_tok
        do = (dst // block_size) * s_blk + (dst % block_size) * s_tok
        x = tl.load(base + so[:, None] + inner[None, :], mask=ok)
        tl.debug_barrier()
        tl.store(base + do[:, None] + inner[None, :], x, mask=ok)


_LOFF: dict = {}
_PLANS: dict = {}  # id(kv_caches list) -> (the list, its layer groups)


def _groups(kv_caches, layout):
    """Layers grouped by view shape/strides/dtype: (base view, layer offsets, shape, strides)
    per group.  Cached per list object (a runner passes the same list every step)."""
    hit = _PLANS.get((id(kv_caches), layout))
    if hit is not None and hit[0] is kv_caches and hit[1] == len(kv_caches):
        return hit[2]
    groups: dict = {}
    for kv in kv_caches:
        tv = token_view(kv, layout)
        groups.setdefault((tuple(tv.shape), tv.stride(), kv.dtype, kv.device), []).append(tv)
    plan = []
    for (shape, st, dtype, dev), views in groups.items():
        base = views[0]
        isz = base.element_size()
        offs = []
        for tv in views:
            delta = tv.data_ptr() - base.data_ptr()
            assert delta % isz == 0
            offs.append(delta // isz)
        key = (str(dev), tuple(offs))
        loff = _LOFF.get(key)
        if loff is None:  # cached: no host-to-device copy inside CUDA-graph capture
            loff = _LOFF[key] = torch.tensor(offs, dtype=torch.int64, device=dev)
        plan.append((base, loff, len(views), shape, st))
    if isinstance(kv_caches, list):
        _PLANS[(id(kv_caches), layout)] = (kv_caches, len(kv_caches), plan)
    return plan


def _compact_triton(kv_caches, src, dst, block_size, layout, rows_args=None):
    """src/dst [N, L] slots, or rows_args = (block_table, start, accepted_rows, num_accepted)
    with the slots computed in the kernel (src/dst then None)."""
    if rows_args is None:
        n, L = src.shape
        src = src.contiguous()
        dst = dst.contiguous()
        bt = start = rows = nacc = src  # unused
        s_bt = s_rows = 0
    else:
        bt, start, rows, nacc = rows_args
        n, L = rows.shape[0], rows.shape[1] - 1
        assert rows.stride(1) == 1 and bt.stride(1) == 1
        src = dst = rows  # unused
        s_bt, s_rows = bt.stride(0), rows.stride(0)
    for base, loff, nl, shape, st in _groups(kv_caches, layout):
        inner = shape[2] * shape[3] * shape[4]
        lp = max(2, next_pow2(L))
        block = max(2, min(next_pow2(inner), 4096 // lp))
        grid = (n, nl, triton.cdiv(inner, block))
        _compact_kernel[grid](base, loff, src, dst, bt, s_bt, start, rows, s_rows, nacc,
                              st[0], st[1], st[2], st[3], st[4], shape[3], shape[4], inner,
                              block_size, L=L, LP=lp, BLOCK=block, FROM_ROWS=rows_args is not None,
                              num_warps=4)
    return kv_caches


def compact_kv(kv_caches, block_table, block_size: int, start_positions, accepted_rows, num_accepted,
               layout: str, backend: str = "auto"):
    """Move accepted rows' K/V in place for every layer in kv_caches (list of tensors)."""
    if not kv_caches:
        return kv_caches
    if use_triton(kv_caches[0], backend):  # one launch per layer group, slots computed inside
        return _compact_triton(kv_caches, None, None, block_size, layout,
                               (block_table, start_positions, accepted_rows, num_accepted))
    src, dst = compaction_slots(block_table, block_size, start_positions, accepted_rows, num_accepted)
    start = start_positions.long()
    root = block_table.long().gather(1, (start // block_size).unsqueeze(1)).squeeze(1) * block_size
    return compact_kv_slots_torch(kv_caches, src, dst, block_size, layout, root + start % block_size)


def compact_kv_slots(kv_caches, src, dst, block_size: int, layout: str, backend: str = "auto"):
    """Slot-based variant: src/dst [N, L] int64 from compaction_slots (-1 = skip)."""
    if not kv_caches:
        return kv_caches
    if use_triton(kv_caches[0], backend):
        return _compact_triton(kv_caches, src, dst, block_size, layout)
    return compact_kv_slots_torch(kv_caches, src, dst, block_size, layout)
