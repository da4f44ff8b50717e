"""Per-step DDTree bookkeeping on vLLM's V2 model runner (torch + Triton, no vllm import).

V2 keeps each request in a state slot (``idx_mapping``: batch row -> slot) and its draft
tokens on the GPU (``req_states.draft_tokens[slot]``).  The DDTree speculator stores the
tree behind those tokens by slot too (``SlotTrees``).  A verify step then needs, per
batch row, without a host sync:

  * ``build_pack``: PACK = [nd | prev | roots] (int64 [3n], the layout core/step.py
    reads): tree nodes verified (0: no tree), slot of the stored tree (-1: none), token
    row of the root (-1: none).  A row verifies a tree iff it has drafts and its root
    lies past the prompt (V2 treats draft rows of a step that starts inside the
    prefill as placeholders and rejects them).  A chain step (``chain``) verifies such
    a row's drafts as a chain: nd = its drafts, prev = roots = -1 (linear positions,
    causal attention, a chain walk, nothing to move);
  * then core/step.py's ``prepare`` / ``commit`` / ``move_rows`` (one Triton launch each,
    or their torch references there): tree positions, TreeState rows, walk parents;
    then positions back to linear and the accepted path's source/destination rows;
  * ``verify_rows``: the logits rows of each request (root, then node k);
  * ``uniforms``: per-request seeded uniforms for the sampled walk, keyed by (seed,
    position) like V2's own sampling, so a seeded request gives the same output
    whatever batch it runs in;
  * ``sampler_outputs``: the walk in V2's rejection-sampler format.
"""

from __future__ import annotations

import torch

from ..core._triton import HAS_TRITON, next_pow2, tl, triton
from ..core.step import use_fused  # noqa: F401  (the runtime's choice, re-exported)
from ..core.tree_build import chain_depths, chain_parents

UNIFORM_SALT = 0x5DD7EE  # keeps the walk's stream apart from other uses of a seed


class SlotTrees:
    """The tree of every request-state slot (what its draft tokens mean): parents,
    depths, ancestor-or-self masks over verify rows, node counts.  Slots start as
    chains, so drafts verified before any tree was stored are still exact."""

    def __init__(self, max_reqs: int, budget: int, device):
        self.parents = chain_parents(budget, device).expand(max_reqs, budget).clone()
        self.depths = chain_depths(budget, device).expand(max_reqs, budget).clone()
        chain = torch.ones(budget + 1, budget + 1, dtype=torch.bool, device=device).tril()
        self.ancestor_mask = chain.expand(max_reqs, -1, -1).clone()
        self.num_nodes = torch.full((max_reqs,), budget, dtype=torch.int64, device=device)

    def store(self, slots: torch.Tensor, tree) -> None:
        """tree: core.DDTree [N, B] (with ancestor_mask) of the requests in ``slots``."""
        self.parents[slots] = tree.parents
        self.depths[slots] = tree.depths
        self.ancestor_mask[slots] = tree.ancestor_mask
        self.num_nodes[slots] = tree.num_nodes


# --------------------------------------------------------------------------- pack


def build_pack_torch(pack, n, cu_num_logits, query_start_loc, positions, idx_mapping,
                     prefill_len, stored_nodes, chain: bool = False) -> torch.Tensor:
    cu = cu_num_logits[: n + 1].long()
    drafts = cu[1:] - cu[:-1] - 1
    root = query_start_loc[1: n + 1].long() - 1 - drafts
    slot = idx_mapping[:n].long()
    root_pos = positions[root.clamp(min=0)]
    ok = (drafts > 0) & (root_pos >= prefill_len[slot].long())
    tree = ok & (not chain)
    nd = drafts if chain else torch.minimum(drafts, stored_nodes[slot].long())
    pack[:n] = torch.where(ok, nd, 0)
    pack[n: 2 * n] = torch.where(tree, slot, -1)
    pack[2 * n: 3 * n] = torch.where(tree, root, -1)
    return pack


if HAS_TRITON:

    @triton.jit
    def _pack_kernel(PACK, n, CU, QSL, POS, IDX, PREFILL, NODES, CHAIN: tl.constexpr,
                     BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        m = r < n
        c0 = tl.load(CU + r, mask=m, other=0).to(tl.int64)
        c1 = tl.load(CU + r + 1, mask=m, other=0).to(tl.int64)
        drafts = c1 - c0 - 1
        root = tl.load(QSL + r + 1, mask=m, other=0).to(tl.int64) - 1 - drafts
        slot = tl.load(IDX + r, mask=m, other=0).to(tl.int64)
        root_pos = tl.load(POS + tl.maximum(root, 0), mask=m, other=0)
        pre = tl.load(PREFILL + slot, mask=m, other=0)
        ok = (drafts > 0) & (root_pos >= pre)
        if CHAIN:  # no row has a tree (drafts > 0 where ok): prev = root = -1
            tree = ok & (drafts < 0)
            nd = drafts
        else:
            tree = ok
            nd = tl.minimum(drafts, tl.load(NODES + slot, mask=m, other=0).to(tl.int64))
        tl.store(PACK + r, tl.where(ok, nd, 0), mask=m)
        tl.store(PACK + n + r, tl.where(tree, slot, -1), mask=m)
        tl.store(PACK + 2 * n + r, tl.where(tree, root, -1), mask=m)


def build_pack(pack, n, cu_num_logits, query_start_loc, positions, idx_mapping, prefill_len,
               stored_nodes, fused: bool, chain: bool = False) -> torch.Tensor:
    """pack [>= 3n] int64 <- [nd | prev | roots] of the n batch rows (see module doc)."""
    if not fused:
        return build_pack_torch(pack, n, cu_num_logits, query_start_loc, positions,
                                idx_mapping, prefill_len, stored_nodes, chain)
    _pack_kernel[(1,)](pack, n, cu_num_logits, query_start_loc, positions, idx_mapping,
                       prefill_len, stored_nodes, CHAIN=bool(chain),
                       BLOCK=max(2, next_pow2(n)), num_warps=4)
    return pack


# --------------------------------------------------------------------------- sampler side


def verify_rows(cu_num_logits: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """[n, width + 1] int64 logits row of (root, node 0, ..): cu[i] + min(k, drafts_i);
    rows past a request's drafts repeat its last row (the walk never reads them)."""
    cu = cu_num_logits[: n + 1].long()
    last = cu[1:] - cu[:-1] - 1
    k = torch.arange(width + 1, device=cu.device)
    return cu[:-1].unsqueeze(1) + torch.minimum(k.unsqueeze(0), last.unsqueeze(1))


def sampler_outputs(walk, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled [n, width] int64: accepted path + bonus, -1 padded; num_sampled [n]
    int32 = accepted + 1) from a core.WalkResult."""
    n = walk.output_tokens.shape[0]
    out = torch.full((n, width), -1, dtype=torch.int64, device=walk.output_tokens.device)
    w = min(width, walk.output_tokens.shape[1])
    out[:, :w] = walk.output_tokens[:, :w]
    return out, (walk.num_accepted + 1).to(torch.int32)


if HAS_TRITON:

    @triton.jit
    def _uniforms_kernel(U, SEEDS, POS, W, SALT, BW: tl.constexpr):
        r = tl.program_id(0)
        seed = tl.load(SEEDS + r) ^ SALT
        k = tl.arange(0, BW)
        off = (tl.load(POS + r) + k).to(tl.int32)
        u = tl.rand(seed, off)
        tl.store(U + r * W + k, u, mask=k < W)


def uniforms(seeds: torch.Tensor, pos: torch.Tensor, width: int, fused: bool) -> torch.Tensor:
    """[n, width] float32 in [0, 1): column k for the walk's depth k of a request whose
    root sits at position pos[r]; a function of (seeds[r], pos[r] + k) only (Philox
    on the device; the CPU reference draws from a generator per request and position,
    so the two paths differ in value but not in that property)."""
    n = seeds.shape[0]
    if fused:
        u = torch.empty(n, width, dtype=torch.float32, device=seeds.device)
        if n:
            _uniforms_kernel[(n,)](u, seeds.long().contiguous(), pos.long().contiguous(),
                                   width, UNIFORM_SALT, BW=max(2, next_pow2(width)),
                                   num_warps=1)
        return u
    out = torch.empty(n, width, dtype=torch.float32)
    for r, (s, p) in enumerate(zip(seeds.tolist(), pos.tolist())):
        for k in range(width):
            g = torch.Generator().manual_seed(((s ^ UNIFORM_SALT) * 1_000_003 + p + k)
                                              & 0x7FFF_FFFF_FFFF_FFFF)
            out[r, k] = torch.rand((), generator=g)
    return out.to(seeds.device)
