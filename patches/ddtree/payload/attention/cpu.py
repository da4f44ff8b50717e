"""Tree attention for vLLM's CPU backend: torch over the paged KV cache.

The CPU kernel takes no mask, so verify steps with a tree run here: every query row
sees the request's whole context plus, among this step's rows, its ancestors and
itself (with a sliding window, only the keys inside its window: features.py).  The K/V layout inside a CPU cache block depends on the ISA (K is stored
transposed on the plain vector ISA), so it is read off the backend's own writer
once (``_layout``) rather than assumed.  Also the oracle for the CUDA path.
"""

from __future__ import annotations

import functools

import torch

from .features import check, window_of


def _digits(n: torch.Tensor, k: int) -> torch.Tensor:
    return (n // (64 ** k)) % 64 + 1  # small integers: exact in fp16/bf16/fp32


@functools.lru_cache(maxsize=None)
def _layout(isa: str, block_size: int, head_size: int, dtype: torch.dtype):
    """(k_index, v_index): flat offset, inside one (block, head) region of
    2 * block_size * head_size elements, of element (token, dim) of K and of V."""
    from vllm import _custom_ops as ops

    n = block_size * head_size
    token = torch.arange(block_size).view(-1, 1, 1).expand(block_size, 1, head_size)
    dim = torch.arange(head_size).view(1, 1, -1).expand(block_size, 1, head_size)
    slots = torch.arange(block_size, dtype=torch.int64)
    found = {}
    for name, src in (("t", token), ("d", dim)):
        for k in range(3):
            kv = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
            kc, vc = kv.chunk(2, dim=2)
            code = _digits(src, k).to(dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(code, code, kc, vc, slots, isa)
            found[name, k] = kv.reshape(-1).to(torch.int64) - 1
    t = sum(found["t", k] * 64 ** k for k in range(3))
    d = sum(found["d", k] * 64 ** k for k in range(3))
    idx = t * head_size + d  # which (token, dim) each raw element holds
    k_index = torch.empty(n, dtype=torch.int64)
    v_index = torch.empty(n, dtype=torch.int64)
    pos = torch.arange(2 * n)
    k_index[idx[:n]] = pos[:n]
    v_index[idx[n:]] = pos[n:]
    return k_index, v_index


def read_kv(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int, isa: str):
    """K, V [length, H, D] of one sequence, through its block ids.  ``kv_cache`` is the
    backend's [blocks, H, 2 * block_size, D] view (K rows, then V rows)."""
    nb, heads, two_bs, d = kv_cache.shape
    bs = two_bs // 2
    k_index, v_index = _layout(isa, bs, d, kv_cache.dtype)
    raw = kv_cache.view(nb, heads, 2 * bs * d)[blocks]  # [nblk, H, 2*bs*D]
    k = raw[:, :, k_index].view(-1, heads, bs, d).permute(0, 2, 1, 3).reshape(-1, heads, d)
    v = raw[:, :, v_index].view(-1, heads, bs, d).permute(0, 2, 1, 3).reshape(-1, heads, d)
    return k[:length], v[:length]


def tree_attention(impl, layer, query, key, value, kv_cache, md, output):
    """Attention for a DDTree verify step (all requests of the batch).  ``kv_cache``
    is the backend's [blocks, H, 2 * block_size, D] view.  A sliding window W limits
    every row to keys at positions >= its own - W + 1 (tree keys at their tree
    positions); only the blocks some row can see are read."""
    check(impl)
    window = window_of(impl)
    step = md.ddtree
    n = md.num_actual_tokens
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    group = impl.num_heads // impl.num_kv_heads
    bs = kv_cache.shape[2] // 2
    for r in range(len(qsl) - 1):
        q0, q1 = qsl[r], qsl[r + 1]
        if q1 == q0:
            continue
        q_len, seq_len = q1 - q0, seq_lens[r]
        allowed, qpos = step.visible(r, q_len, seq_len)
        first = 0
        if window is not None:  # keys at positions >= qpos - W + 1; the lowest row's
            first = max(0, int(qpos.min()) - window + 1) // bs  # first block it needs
            kpos = torch.cat([torch.arange(seq_len - q_len), qpos])
            allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
        blocks = md.block_table[r, first: (seq_len + bs - 1) // bs].to(torch.int64)
        k, v = read_kv(kv_cache, blocks, seq_len - first * bs, layer.isa)
        allowed = allowed[:, first * bs:]
        q = query[q0:q1].float()
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * impl.scale
        scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        output[q0:q1].copy_(out.reshape(output[q0:q1].shape).to(output.dtype))
    nb, heads, two_bs, d = kv_cache.shape  # back to the shape the cache writer expects
    step.stash_kv(layer, impl, kv_cache.view(nb, heads, two_bs // 2, 2 * d), key[:n],
                  value[:n], md.slot_mapping[:n])
    return output


class TreeView:
    """The V2 runtime's TreeState (has_tree, ancestor-or-self mask by batch row) as
    ``tree_attention`` reads a step.  A V2 tree request's query rows are its root and
    nodes, so mask row i is query row i; rows without a tree are causal."""

    def __init__(self, state):
        self.state = state

    def visible(self, r: int, q_len: int, seq_len: int):
        ctx = seq_len - q_len
        if int(self.state.has_tree[r]):
            new = self.state.mask[r, :q_len, :q_len].cpu() != 0
        else:
            new = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        pos = ctx + new.sum(1) - 1  # root + depth
        return torch.cat([torch.ones(q_len, ctx, dtype=torch.bool), new], dim=1), pos

    def stash_kv(self, *args) -> None:
        """Nothing: the rows' K/V are in the cache at their linear slots and the V2
        commit moves the accepted ones (``compact_kv``)."""


def compact_kv(caches, isas, block_table, block_size: int, start, rows, num_accepted):
    """core.compact_kv for CPU_ATTN caches ([blocks, H, 2 * block_size, D], K rows then
    V rows, the element order of each (block, head) region set by the ISA: ``_layout``;
    ``isas``: each cache's layer ISA): every accepted row's K/V moves to the slot right
    after its request's root."""
    from ..core.kv_compact import compaction_slots

    src, dst = compaction_slots(block_table, block_size, start, rows, num_accepted)
    keep = torch.nonzero(src.reshape(-1) >= 0).squeeze(1)
    s, d = src.reshape(-1)[keep], dst.reshape(-1)[keep]
    if s.numel() == 0:
        return
    for kv, isa in zip(caches, isas):
        nb, heads, two_bs, dim = kv.shape
        k_index, v_index = _layout(isa, block_size, dim, kv.dtype)
        idx = torch.cat([k_index.view(block_size, dim), v_index.view(block_size, dim)], 1)
        raw = kv.view(nb, heads, two_bs * dim)
        h = torch.arange(heads)[None, :, None]
        vals = raw[(s // block_size)[:, None, None], h, idx[s % block_size][:, None, :]]
        raw[(d // block_size)[:, None, None], h, idx[d % block_size][:, None, :]] = vals
