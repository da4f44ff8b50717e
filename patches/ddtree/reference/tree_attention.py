"""The torch oracle of the tree attention kernel (payload/attention/triton_tree.py):
fp32 math, one request at a time, the kernel's semantics (context visible, new rows
causal or masked by the request's tree).  Used by the tests and bench/gpu/attn_sweep."""

import torch

from ..payload.attention.tiles import head_view


def reference_tree_attention(query, key_cache, value_cache, block_table, seq_lens,
                             query_start_loc, has_tree, mask, scale, num_kv_heads,
                             window=None):
    """torch oracle (fp32 math) with the kernel's semantics; returns [T, Hq, D].
    window: a sliding window W: a row at position p sees keys at positions
    >= p - W + 1, where tree rows sit at root + depth (depth: ancestors in the mask)."""
    d = key_cache.shape[-1]
    hq = query.shape[1] if query.dim() == 3 else query.shape[1] // d
    q_all = head_view(query, hq)
    out = torch.zeros(q_all.shape, dtype=torch.float32, device=query.device)
    bs = key_cache.shape[1]
    qsl = query_start_loc.tolist()
    sl = seq_lens.tolist()
    g = hq // num_kv_heads
    for r in range(len(qsl) - 1):
        q0, q1 = qsl[r], qsl[r + 1]
        if q1 <= q0:
            continue
        q_len, seq_len = q1 - q0, sl[r]
        ctx = seq_len - q_len
        pos = torch.arange(seq_len, device=query.device)
        blk = block_table[r, pos // bs].long()
        k = key_cache[blk, pos % bs].float().repeat_interleave(g, dim=1)  # [S, Hq, D]
        v = value_cache[blk, pos % bs].float().repeat_interleave(g, dim=1)
        q = q_all[q0:q1].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        new = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        rel = torch.arange(q_len, device=query.device)
        if int(has_tree[r]):
            new = mask[r, :q_len, :q_len] != 0
            rel = new.sum(1) - 1
        vis = torch.cat([torch.ones(q_len, ctx, dtype=torch.bool, device=query.device), new], 1)
        if window is not None:
            kpos = torch.cat([pos[:ctx], ctx + rel])
            vis &= kpos[None, :] >= (ctx + rel)[:, None] - window + 1
        s = s.masked_fill(~vis.unsqueeze(0), float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out
