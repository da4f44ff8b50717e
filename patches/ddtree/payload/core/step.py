"""Fused per-step bookkeeping of the CUDA runtime (one Triton launch each), so that
the host work between two forwards stays small:

* ``prepare``: per request, tree positions (root position + depth), the static mask
  rows and has-tree flags the tree attention reads, and the parents the walk uses
  (the stored tree's, or a chain for drafts without a tree); rows >= n get
  has_tree = 0.
* ``commit``: per request, positions back to linear, input ids of the accepted path
  moved to the rows right after the root, the path's source/destination rows (for
  the drafter's aux hidden states), the KV start position and the accepted count.

``PACK`` is the int64 array [nd (n) | prev (n) | roots (n)]: drafts per request,
index of its stored tree (-1: none) and token row of its root (-1: no drafts).
``prepare`` / ``commit`` / ``move_rows`` launch the kernels when ``fused`` (use_fused:
CUDA, or the Triton interpreter), else run their torch references here (the tests
compare both).  V1's CUDA runtime and V2's runtime both go through them.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, interpreting, next_pow2, tl, triton
from .tree_build import chain_parents


def use_fused(device) -> bool:
    """The Triton kernels on CUDA (or the interpreter); the torch references elsewhere."""
    return HAS_TRITON and (torch.device(device).type == "cuda" or interpreting())

if HAS_TRITON:

    @triton.jit
    def _prepare_kernel(PACK, n, W, DEP, s_dep, PAR, s_par, ANC, s_a0, s_a1, POS, HAS,
                        MASK, s_m0, s_m1, WPAR, s_wp,
                        R: tl.constexpr, BW: tl.constexpr, BR: tl.constexpr,
                        RB: tl.constexpr):
        r = tl.program_id(0)
        if r >= n:
            tl.store(HAS + r, 0)
            return
        nd = tl.load(PACK + r)
        prev = tl.load(PACK + n + r)
        root = tl.load(PACK + 2 * n + r)
        w = tl.arange(0, BW)
        wm = w < W
        if prev >= 0:
            tl.store(HAS + r, 1)
            dm = w < nd
            dep = tl.load(DEP + prev * s_dep + w, mask=dm, other=0)
            p0 = tl.load(POS + root)
            tl.store(POS + root + 1 + w, p0 + dep, mask=dm)
            par = tl.load(PAR + prev * s_par + w, mask=wm, other=-1)
            tl.store(WPAR + r * s_wp + w, par, mask=wm)
            c = tl.arange(0, BR)
            for i0 in range(0, R, RB):
                i = i0 + tl.arange(0, RB)
                m = (i < R)[:, None] & (c < R)[None, :]
                v = tl.load(ANC + prev * s_a0 + i[:, None] * s_a1 + c[None, :], mask=m)
                tl.store(MASK + r * s_m0 + i[:, None] * s_m1 + c[None, :], v, mask=m)
        else:
            tl.store(HAS + r, 0)
            tl.store(WPAR + r * s_wp + w, w - 1, mask=wm)

    @triton.jit
    def _commit_kernel(PACK, n, ROWS, s_rows, NACC, POS, IDS, SRC, DST, START, NEFF,
                       W: tl.constexpr, BW: tl.constexpr, MAXD: tl.constexpr):
        r = tl.program_id(0)
        nd = tl.load(PACK + r)
        prev = tl.load(PACK + n + r)
        root = tl.load(PACK + 2 * n + r)
        w = tl.arange(0, BW)
        wm = w < W
        valid = root >= 0
        rc = tl.maximum(root, 0)
        p0 = tl.load(POS + rc)
        if prev >= 0:  # positions back to linear, every tree row: V1's DFlash writes
            # each row's context K/V at its position (rejected rows too), so a row left
            # at its tree position would overwrite an accepted token's drafter KV
            for off in range(0, MAXD, BW):  # MAXD: the engine's budget B
                tl.store(POS + rc + 1 + off + w, p0 + 1 + off + w, mask=off + w < nd)
        nacc = tl.where(valid, tl.load(NACC + r).to(tl.int64), 0)
        tl.store(START + r, p0)
        tl.store(NEFF + r, nacc)
        rows = tl.load(ROWS + r * s_rows + 1 + w, mask=wm, other=0).to(tl.int64)
        ok = (w < nacc) & wm
        src = tl.where(ok, rc + rows, -1)
        dst = tl.where(ok, rc + 1 + w, -1)
        tl.store(SRC + r * W + w, src, mask=wm)
        tl.store(DST + r * W + w, dst, mask=wm)
        # rows on a path increase (rows[j] >= j + 1): read every source, then write
        x = tl.load(IDS + src, mask=ok)
        tl.debug_barrier()
        tl.store(IDS + dst, x, mask=ok)

    @triton.jit
    def _move_rows_kernel(H0, H1, H2, H3, H4, H5, H6, H7, s_h, SRC, DST, D,
                          L: tl.constexpr, BD: tl.constexpr):
        # one program: one request's path x BD columns of one of up to 8 tensors (same
        # shape/dtype/strides); ascending j never reads a row an earlier j wrote (the
        # src row of j is >= j + 1 > every earlier dst row)
        r = tl.program_id(0)
        c = tl.program_id(1) * BD + tl.arange(0, BD)
        k = tl.program_id(2)
        H = H0
        if k == 1:
            H = H1
        elif k == 2:
            H = H2
        elif k == 3:
            H = H3
        elif k == 4:
            H = H4
        elif k == 5:
            H = H5
        elif k == 6:
            H = H6
        elif k == 7:
            H = H7
        cm = c < D
        for j in range(L):
            s = tl.load(SRC + r * L + j)
            if s >= 0:
                d = tl.load(DST + r * L + j)
                x = tl.load(H + s * s_h + c, mask=cm)
                tl.store(H + d * s_h + c, x, mask=cm)


def prepare(pack, n, width, tree, positions, has_tree, mask, walk_parents, fused: bool):
    """Tree positions, TreeState rows (has_tree over all its rows, mask) and the walk's
    parents [n, width] of this step; tree (parents, depths, ancestor_mask by the pack's
    prev index) may be None when no row has one (prev < 0 everywhere)."""
    if not fused:
        return prepare_torch(pack, n, width, tree, positions, has_tree, mask, walk_parents)
    rows = mask.shape[1]
    if tree is None:
        dep = par = walk_parents
        anc = mask
    else:
        dep, par, anc = tree.depths, tree.parents, tree.ancestor_mask.view(torch.int8)
    br = next_pow2(rows)
    rb = max(1, min(br, 2048 // br))
    _prepare_kernel[(has_tree.shape[0],)](
        pack, n, width, dep, dep.stride(0), par, par.stride(0), anc, anc.stride(0),
        anc.stride(1), positions, has_tree, mask, mask.stride(0), mask.stride(1),
        walk_parents, walk_parents.stride(0),
        R=rows, BW=next_pow2(max(width, 1)), BR=br, RB=rb, num_warps=4)


def prepare_torch(pack, n, width, tree, positions, has_tree, mask, walk_parents) -> None:
    """Reference of _prepare_kernel: tree rows get position = root + depth, TreeState
    rows (has_tree, mask) come from the stored trees, the walk gets their parents (a
    chain for rows without a tree); has_tree rows >= n are cleared."""
    nd, prev, roots = pack[:n], pack[n: 2 * n], pack[2 * n: 3 * n]
    rows = prev >= 0
    has = torch.zeros_like(has_tree)
    has[:n] = rows.to(has.dtype)
    has_tree.copy_(has)
    chain = chain_parents(width, pack.device).expand(n, width)
    if tree is None:
        walk_parents.copy_(chain)
        return
    p = prev.clamp(min=0)
    walk_parents.copy_(torch.where(rows.unsqueeze(1), tree.parents[p, :width], chain))
    ar = torch.arange(width, device=pack.device)
    sel = rows.unsqueeze(1) & (ar.unsqueeze(0) < nd.unsqueeze(1))
    at = roots.clamp(min=0).unsqueeze(1) + 1 + ar
    new = positions[roots.clamp(min=0)].unsqueeze(1) + tree.depths[p, :width]
    positions[at[sel]] = new[sel]
    r = mask.shape[1]
    keep = mask[:n].clone()
    keep[rows] = tree.ancestor_mask[p[rows], :r, :r].to(mask.dtype)
    mask[:n] = keep


def commit(pack, n, rows, nacc, positions, input_ids, src, dst, start, neff, fused: bool,
           max_drafts: int):
    """Positions back to linear (all of a request's draft rows, up to ``max_drafts``, the
    engine's B), the accepted path's input ids and source / destination rows; src/dst
    [n, W] (W = rows.shape[1] - 1), start/neff [n]."""
    if not fused:
        return commit_torch(pack, n, rows, nacc, positions, input_ids, src, dst, start,
                            neff, max_drafts)
    w = rows.shape[1] - 1
    bw = next_pow2(max(w, 1))
    _commit_kernel[(n,)](pack, n, rows, rows.stride(0), nacc, positions, input_ids, src, dst,
                         start, neff, W=w, BW=bw, MAXD=max(int(max_drafts), 1),
                         num_warps=4)


def commit_torch(pack, n, rows, nacc, positions, input_ids, src, dst, start, neff,
                 max_drafts: int) -> None:
    """Reference of _commit_kernel: every tree row back to its linear position (V1's
    DFlash stores context K/V for all verified rows, rejected ones included, at their
    positions: a row left at its tree position, root + depth, would overwrite an
    accepted token's drafter KV; #31's H100 pair lost 33-42 % of its tau at B = 64-256);
    per request the root position (start), the accepted count (neff) and the [n, W]
    source / destination token rows of its path (-1 padded); input ids moved along the
    path."""
    nd, prev, roots = pack[:n], pack[n: 2 * n], pack[2 * n: 3 * n]
    w = rows.shape[1] - 1
    valid = roots >= 0
    rc = roots.clamp(min=0)
    p0 = positions[rc]
    bw = torch.arange(max(w, int(max_drafts), 1), device=pack.device)
    sel = (prev >= 0).unsqueeze(1) & (bw.unsqueeze(0) < nd.unsqueeze(1))
    positions[(rc.unsqueeze(1) + 1 + bw)[sel]] = (p0.unsqueeze(1) + 1 + bw)[sel]
    ar = bw[:w]
    na = torch.where(valid, nacc.long(), 0)
    start[:n] = p0
    neff[:n] = na
    ok = ar.unsqueeze(0) < na.unsqueeze(1)
    s = torch.where(ok, rc.unsqueeze(1) + rows[:, 1:].long(), -1)
    d = torch.where(ok, rc.unsqueeze(1) + 1 + ar, -1)
    src.copy_(s)
    dst.copy_(d)
    input_ids[d[ok]] = input_ids[s[ok]].clone()


def move_rows(hs, src, dst, fused: bool):
    """h[dst] = h[src] for every h in hs ([T, D] tensors, rows contiguous) along the
    -1-padded [n, W] path rows of commit: one launch per 8 tensors of one kind."""
    if not fused:
        ok = src >= 0
        s, d = src[ok], dst[ok]
        for h in hs:
            h[d] = h[s].clone()
        return
    n, w = src.shape
    groups: dict = {}
    for h in hs:
        groups.setdefault((h.shape[1], h.stride(), h.dtype, h.device), []).append(h)
    for (d, st, _, _), g in groups.items():
        assert st[1] == 1
        bd = min(1024, next_pow2(d))
        for i in range(0, len(g), 8):
            part = g[i: i + 8]
            ptrs = part + [part[0]] * (8 - len(part))
            _move_rows_kernel[(n, triton.cdiv(d, bd), len(part))](
                *ptrs, st[0], src, dst, d, L=w, BD=bd, num_warps=4)


def commit_views(walk, n: int, device, src, dst, start, neff):
    """commit()'s walk inputs and output views: (rows, num_accepted) of the walk (an
    empty path when no walk ran: positions go back only) and the first n rows of a
    runtime's src / dst / start / neff buffers."""
    if walk is None:
        rows = torch.zeros(n, 2, dtype=torch.int64, device=device)
        nacc = rows[:, 0]
    else:
        rows, nacc = walk.accepted_rows, walk.num_accepted
    w = rows.shape[1] - 1
    return rows, nacc, src[: n * w].view(n, w), dst[: n * w].view(n, w), start[:n], neff[:n]
