"""Exact DDTree tree build (Algorithm 1's node set) on the device, batched, no host sync.

Scores.  Draft log-probs are quantised to fixed point, q = floor(lp * 2**26) as int64
(clamped to <= 0; lp < -65536, -inf and NaN mark the token as excluded: it never
enters a tree).  A node's score is the exact integer sum of its path's q values, so
sums are associative and every implementation (torch, Triton, the Python heap)
gets bit-identical scores.

Ranks.  Only the top K = min(max_budget, V) tokens per depth can matter (a node of
rank r > B has r - 1 >= B better siblings).  Which K enter (vocab_topk): the K largest
by (input value descending, token id ascending), i.e. on an exact tie at the K-th
place the lower ids enter (NaN counts as -inf, -0.0 as +0.0).  That is the heap
reference's rule (heap_reference.canonical_lists) on log-prob inputs; on logits the
values are compared before the lse is subtracted.  Inside the K, rank order is (q
descending, token id ascending).

Total order ("key"), used by the heap and here alike, smaller = popped first:
    key(x) = (-score(x), depth(x), key(parent(x)), rank(x))
i.e. higher score first; on equal score the shallower node; at equal depth the
node whose parent comes first; among siblings the lower rank.  The heap pops in
exactly this order because each node's key is larger than the key of the node that
pushes it (its parent: score <= parent score since q <= 0, and if equal the depth
is larger; its previous sibling: q non-increasing in rank, same parent, larger
rank).  So Algorithm 1 returns the B smallest keys, in key order ("pop order"),
parents before children.

Per-depth beam, and why it is exact.  Let Beam_d be the B smallest keys among all
depth-d nodes, in key order (B = max_budget).
 (1) The global top-B set T satisfies T ∩ depth d ⊆ Beam_d (fewer than B nodes
     anywhere beat a member of T).
 (2) Beam_d ⊆ {children of Beam_{d-1} with rank < K}.  If x = (p, r) is in Beam_d
     but p is not in Beam_{d-1}, B depth-(d-1) nodes y have key(y) < key(p); then
     key((y, r)) < key((p, r)): score(y) >= score(p) gives score(y,r) >= score(p,r)
     (integer sums: strict stays strict) and on equal scores the parent decides.
     B distinct nodes beat x at depth d, contradiction.  Rank < K as noted above.
 (3) Hyperbolic pruning: with Beam_{d-1} in key order (index i) and ranks r, the
     candidate (i, r) is beaten by every (i', r') with i' <= i, r' <= r (same
     argument, ties resolved by parent index then rank), so it can be in Beam_d
     only if (i + 1) * (r + 1) <= B.  That leaves ~B ln B static candidate pairs.
 (4) The candidates are enumerated in (i, r) order, so sorting them by score with
     ties kept in enumeration order (stable sort / index in the low key bits)
     yields exactly the key order; Beam_d is the first B.
 (5) T = the B smallest keys of the union of the beams; across the union the key
     order is (score desc, depth asc, beam index asc).  For a per-request budget
     b <= B, the first b of that order are Algorithm 1's tree with budget b.
 A selected node's parent is selected too (its key is smaller), so parents are
 found by index lookup.  Excluded (-inf) tokens carry no score and never enter.

Outputs (see DDTree): nodes 0..B_max-1 in pop order; pad slots have token 0,
parent -1, depth 0, score -inf.
"""

from dataclasses import dataclass
import functools

import torch

from ._triton import HAS_TRITON, next_pow2, tl, triton, use_triton
from .vocab_topk import TOK_BITS, order_keys, row_logsumexp, vocab_topk  # noqa: F401 (re-exported)

FRAC_BITS = 26
LP_MIN = -65536.0  # log-probs below this are treated as -inf (excluded)
Q_NEG = -(1 << 43)  # quantised log-prob of an excluded token
S_NEG = -(1 << 62)  # score of an empty beam slot
MAX_DEPTH = 64


@dataclass
class DDTree:
    """A batch of trees; verify row 0 is the root, row r is node r - 1."""

    tokens: torch.Tensor  # [N, B_max] int64, pad 0
    parents: torch.Tensor  # [N, B_max] int64 node index, -1 = child of root (and pads)
    depths: torch.Tensor  # [N, B_max] int64, 1-based, pad 0
    num_nodes: torch.Tensor  # [N] int64
    scores: torch.Tensor  # [N, B_max] float32 sum of quantised log q, pad -inf
    ancestor_mask: torch.Tensor | None  # [N, B_max+1, B_max+1] bool over verify rows
    position_offsets: torch.Tensor  # [N, B_max+1] int64: 0 root, depth for nodes, 0 pads
    max_depth: int  # L: the number of draft positions
    max_budget: int  # B_max


def chain_parents(width: int, device) -> torch.Tensor:
    """[width] int64: a chain's parents (node k hangs under node k - 1, node 0 under the
    root: -1), the shape of drafts verified without a tree."""
    return torch.arange(-1, width - 1, device=device)


def chain_depths(width: int, device) -> torch.Tensor:
    """[width] int64: a chain's depths (node k at depth k + 1)."""
    return torch.arange(1, width + 1, device=device)


def quantize_logprobs(lp: torch.Tensor) -> torch.Tensor:
    """float log-probs -> int64 fixed point (units 2**-26), excluded -> Q_NEG."""
    x = lp.float()
    ok = x >= LP_MIN  # False for -inf and NaN
    x = torch.where(ok, x.clamp(max=0.0), torch.zeros_like(x))
    q = torch.floor(x * float(1 << FRAC_BITS)).to(torch.int64)
    return torch.where(ok, q, torch.full_like(q, Q_NEG))


def canonical_topk(vals: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor | None):
    """Top-K values/ids (any order) -> (q, tokens) in rank order (q desc, id asc)."""
    lp = vals.float()
    if lse is not None:
        lp = lp - lse.unsqueeze(-1)
    q = quantize_logprobs(lp)
    low = (1 << TOK_BITS) - 1
    key = q * (1 << TOK_BITS) + (low - idx.to(torch.int64))
    key = torch.sort(key, dim=-1, descending=True).values
    return key >> TOK_BITS, low - (key & low)


_PAIRS: dict = {}


def candidate_pairs(bmax: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Static (beam index i, rank r) pairs with (i+1)(r+1) <= bmax, r < k, in (i, r) order.

    Cached per device; call once outside CUDA-graph capture.
    """
    key = (bmax, k, str(device))
    if key not in _PAIRS:
        ci, cr = [], []
        for i in range(bmax):
            for r in range(min(k, bmax // (i + 1))):
                ci.append(i)
                cr.append(r)
        _PAIRS[key] = (
            torch.tensor(ci, dtype=torch.int32, device=device),
            torch.tensor(cr, dtype=torch.int32, device=device),
        )
    return _PAIRS[key]


def _budget_tensor(budget, n: int, bmax: int, device) -> torch.Tensor:
    if isinstance(budget, torch.Tensor):
        b = budget.to(device=device, dtype=torch.int64).reshape(-1)
        if b.numel() == 1 and n != 1:
            b = b.expand(n)
    else:
        b = torch.full((n,), int(budget), dtype=torch.int64, device=device)
    return b.clamp(0, bmax)


# --------------------------------------------------------------------------- torch


def _core_torch(q, tok, budget, bmax):
    """Beam build from canonical (q, tok) [N, L, K]; returns nodes in pop order."""
    n, L, k = q.shape
    dev = q.device
    ci, cr = candidate_pairs(bmax, k, dev)
    ci, cr = ci.long(), cr.long()
    neg = torch.full((), S_NEG, dtype=torch.int64, device=dev)  # no host copy: capturable
    w = min(k, bmax)
    beam = torch.full((n, bmax), S_NEG, dtype=torch.int64, device=dev)
    q0 = q[:, 0, :w]
    beam[:, :w] = torch.where(q0 > Q_NEG, q0, neg)
    scores = [beam]
    pars = [torch.full((n, bmax), -1, dtype=torch.int64, device=dev)]
    ranks = [torch.arange(bmax, device=dev).clamp(max=k - 1).expand(n, bmax)]
    for d in range(1, L):
        ps = beam[:, ci]
        qs = q[:, d, cr]
        ok = (ps > S_NEG) & (qs > Q_NEG)
        cs = torch.where(ok, ps + qs, neg)
        top, order = torch.sort(cs, dim=1, descending=True, stable=True)
        beam, order = top[:, :bmax], order[:, :bmax]
        scores.append(beam)
        pars.append(ci[order])
        ranks.append(cr[order])
    flat_s = torch.stack(scores, 1).reshape(n, L * bmax)
    flat_p = torch.stack(pars, 1).reshape(n, L * bmax)
    flat_r = torch.stack(ranks, 1).reshape(n, L * bmax)
    top, order = torch.sort(flat_s, dim=1, descending=True, stable=True)
    top, order = top[:, :bmax], order[:, :bmax]
    j = torch.arange(bmax, device=dev)
    valid = (top > S_NEG) & (j.unsqueeze(0) < budget.unsqueeze(1))
    d = order // bmax
    pos_of = torch.full((n, L * bmax + 1), -1, dtype=torch.int64, device=dev)
    pos_of.scatter_(1, torch.where(valid, order, L * bmax), j.expand(n, bmax).contiguous())
    pflat = (d - 1) * bmax + flat_p.gather(1, order)
    parents = pos_of.gather(1, pflat.clamp(min=0))
    parents = torch.where(valid & (d > 0), parents, -1)
    rank = flat_r.gather(1, order)
    tokens = tok.reshape(n, L * k).gather(1, d * k + rank)
    tokens = torch.where(valid, tokens, 0)
    depths = torch.where(valid, d + 1, 0)
    sc = _float_scores(torch.where(valid, top, neg))
    pos = torch.cat([torch.zeros(n, 1, dtype=torch.int64, device=dev), depths], 1)
    return tokens, parents, depths, sc, pos, valid.sum(1)


def _float_scores(sc: torch.Tensor) -> torch.Tensor:
    """int64 fixed-point scores -> float32 log q (pads -inf); same ops as the kernel."""
    return torch.where(sc > S_NEG, sc.double() / float(1 << FRAC_BITS), float("-inf")).float()


def ancestor_mask_torch(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N, B+1, B+1] bool: row i sees row j iff j is an ancestor-or-self of i (root: all)."""
    n, b = parents.shape
    dev = parents.device
    prow = torch.cat([torch.zeros(n, 1, dtype=torch.int64, device=dev), parents + 1], 1)
    cur = torch.arange(b + 1, device=dev).expand(n, b + 1)
    anc = [cur, torch.zeros_like(cur)]
    for _ in range(max_depth):
        cur = prow.gather(1, cur)
        anc.append(cur)
    mask = torch.zeros(n, b + 1, b + 1, dtype=torch.bool, device=dev)
    mask.scatter_(2, torch.stack(anc, 2), True)
    return mask


# --------------------------------------------------------------------------- triton

if HAS_TRITON:

    @triton.jit
    def _build_kernel(
        vals_ptr, idx_ptr, lse_ptr, budget_ptr, ci_ptr, cr_ptr,
        qs_ptr, tk_ptr, bp_ptr, br_ptr, pos_ptr,
        out_tok, out_par, out_dep, out_sc, out_pos, out_num,
        K, H, BMAX,
        L: tl.constexpr, LP: tl.constexpr, HAS_LSE: tl.constexpr, KP: tl.constexpr, BP: tl.constexpr, HP: tl.constexpr,
        LBP: tl.constexpr, IDXB: tl.constexpr, IDXB2: tl.constexpr,
    ):
        # One program per request; see the module docstring for the algorithm.
        n = tl.program_id(0).to(tl.int64)
        I64_MIN: tl.constexpr = -9223372036854775808
        QN: tl.constexpr = -8796093022208  # Q_NEG
        SN: tl.constexpr = -4611686018427387904  # S_NEG
        LOW: tl.constexpr = 1048575  # 2**TOK_BITS - 1
        # 1) canonical rank order per depth (one 2-D sort): key = q * 2**20 + (LOW - token)
        k = tl.arange(0, KP)[None, :]
        dl = tl.arange(0, LP)[:, None]
        km = (k < K) & (dl < L)
        off = (n * L + dl) * K + k
        v = tl.load(vals_ptr + off, mask=km, other=0.0).to(tl.float32)
        if HAS_LSE:
            v = v - tl.load(lse_ptr + n * L + dl, mask=dl < L, other=0.0)
        ok1 = v >= -65536.0
        x = tl.where(ok1, tl.minimum(v, 0.0), 0.0)
        q = tl.floor(x * 67108864.0).to(tl.int64)
        q = tl.where(ok1 & km, q, QN)
        t = tl.load(idx_ptr + off, mask=km, other=0).to(tl.int64)
        key1 = tl.where(km, q * 1048576 + (LOW - t), I64_MIN)
        key1 = tl.sort(key1, dim=1, descending=True)
        soff = (n * L + dl) * KP + k
        tl.store(qs_ptr + soff, key1 >> 20, mask=dl < L)
        tl.store(tk_ptr + soff, LOW - (key1 & LOW), mask=dl < L)
        tl.debug_barrier()
        # 2) depth-1 beam = the first min(K, BMAX) ranks
        j = tl.arange(0, BP)
        w = tl.minimum(K, BMAX)
        q0 = tl.load(qs_ptr + n * L * KP + j, mask=j < w, other=QN)
        beam = tl.where(q0 > QN, q0, SN)  # current beam scores, in registers
        tl.store(bp_ptr + n * L * BP + j, tl.full([BP], -1, tl.int32))
        tl.store(br_ptr + n * L * BP + j, j.to(tl.int32))
        # running global top-BP (key = score << IDXB2 | LBP-1-flat, flat = depth * BP + j)
        run = tl.where((j < BMAX) & (q0 > QN), (q0 << IDXB2) | (LBP - 1 - j), I64_MIN)
        # 3) deeper beams over the static hyperbolic candidate pairs
        c = tl.arange(0, HP)
        cm = c < H
        ci = tl.load(ci_ptr + c, mask=cm, other=0)
        cr = tl.load(cr_ptr + c, mask=cm, other=0)
        nl = tl.full([], L, tl.int32)
        qd = tl.load(qs_ptr + (n * L + 1) * KP + cr, mask=cm & (nl > 1), other=QN)
        for d in range(1, L):
            ps = tl.gather(beam, ci, 0)
            ok3 = cm & (ps > SN) & (qd > QN)
            key3 = tl.where(ok3, ((ps + qd) << IDXB) | (HP - 1 - c), I64_MIN)
            # prefetch the next depth's log-probs while this one is selected
            qd = tl.load(qs_ptr + (n * L + d + 1) * KP + cr, mask=cm & (d + 1 < L), other=QN)
            top3 = tl.topk(key3, BP)
            vj = (j < BMAX) & (top3 > I64_MIN)
            cidx = ((HP - 1) - (top3 & (HP - 1))).to(tl.int32)
            beam = tl.where(vj, top3 >> IDXB, SN)
            tl.store(bp_ptr + (n * L + d) * BP + j, tl.gather(ci, cidx, 0))
            tl.store(br_ptr + (n * L + d) * BP + j, tl.gather(cr, cidx, 0))
            gk = tl.where(vj, (beam << IDXB2) | (LBP - 1 - (d * BP + j)), I64_MIN)
            run = tl.topk(tl.reshape(tl.join(run, gk), [2 * BP]), BP)
        # 4) the running list is the global order: (score desc, depth asc, beam index asc)
        top = run
        bud = tl.load(budget_ptr + n)
        nv = (j < BMAX) & (j < bud) & (top > I64_MIN)
        flat = (LBP - 1) - (top & (LBP - 1))
        dd = flat // BP
        tl.store(pos_ptr + n * LBP + flat, j, mask=nv)
        tl.debug_barrier()
        pb = tl.load(bp_ptr + n * L * BP + flat, mask=nv, other=0).to(tl.int64)
        pnode = tl.load(pos_ptr + n * LBP + (dd - 1) * BP + pb, mask=nv & (dd > 0), other=-1)
        rk = tl.load(br_ptr + n * L * BP + flat, mask=nv, other=0).to(tl.int64)
        tv = tl.load(tk_ptr + (n * L + dd) * KP + rk, mask=nv, other=0)
        om = j < BMAX
        dep = tl.where(nv, dd + 1, 0)
        sc = tl.where(nv, (top >> IDXB2).to(tl.float64) / 67108864.0, float("-inf")).to(tl.float32)
        tl.store(out_tok + n * BMAX + j, tl.where(nv, tv, 0), mask=om)
        tl.store(out_par + n * BMAX + j, tl.where(nv & (dd > 0), pnode.to(tl.int64), -1), mask=om)
        tl.store(out_dep + n * BMAX + j, dep, mask=om)
        tl.store(out_sc + n * BMAX + j, sc, mask=om)
        tl.store(out_pos + n * (BMAX + 1) + 1 + j, dep, mask=om)
        tl.store(out_pos + n * (BMAX + 1), 0)
        tl.store(out_num + n, tl.sum(nv.to(tl.int64), 0))

    @triton.jit
    def _mask_kernel(par_ptr, mask_ptr, BMAX, R, L: tl.constexpr, ROWS: tl.constexpr, CP: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, CP)
        rm = rows < R
        cur = rows.to(tl.int64)
        acc = (cur[:, None] == cols[None, :]) | (cols[None, :] == 0)
        for _ in range(0, L):
            has = rm & (cur > 0)
            p = tl.load(par_ptr + n * BMAX + cur - 1, mask=has, other=-1)
            cur = tl.where(has, p + 1, 0)
            acc = acc | (cur[:, None] == cols[None, :])
        out = mask_ptr + n * R * R + rows[:, None].to(tl.int64) * R + cols[None, :]
        tl.store(out, acc.to(tl.int8), mask=rm[:, None] & (cols[None, :] < R))


def _core_triton(vals, idx, lse, budget, bmax):
    n, L, k = vals.shape
    dev = vals.device
    ci, cr = candidate_pairs(bmax, k, dev)
    h = ci.numel()
    # >= 2: tl.sort/tl.topk break on single-element tensors
    kp, bp, hp = max(2, next_pow2(k)), max(2, next_pow2(bmax)), max(2, next_pow2(h))
    lbp = next_pow2(L) * bp
    vals = vals.contiguous()
    idx = idx.contiguous()
    i64 = dict(dtype=torch.int64, device=dev)
    qs = torch.empty(n, L, kp, **i64)
    tk = torch.empty(n, L, kp, **i64)
    bpar = torch.empty(n, L, bp, dtype=torch.int32, device=dev)
    brk = torch.empty(n, L, bp, dtype=torch.int32, device=dev)
    pos = torch.empty(n, lbp, dtype=torch.int32, device=dev)
    tokens = torch.empty(n, bmax, **i64)
    parents = torch.empty(n, bmax, **i64)
    depths = torch.empty(n, bmax, **i64)
    sc = torch.empty(n, bmax, dtype=torch.float32, device=dev)
    pos_off = torch.empty(n, bmax + 1, **i64)
    num = torch.empty(n, **i64)
    big = max(hp, next_pow2(L) * kp, 2 * bp)  # largest register tensor
    warps = 4 if big <= 1024 else (8 if big <= 4096 else 16)
    _build_kernel[(n,)](
        vals, idx, lse if lse is not None else vals, budget, ci, cr,
        qs, tk, bpar, brk, pos,
        tokens, parents, depths, sc, pos_off, num,
        k, h, bmax,
        L=L, LP=next_pow2(L), HAS_LSE=lse is not None, KP=kp, BP=bp, HP=hp, LBP=lbp,
        IDXB=hp.bit_length() - 1, IDXB2=lbp.bit_length() - 1,
        num_warps=warps,
    )
    return tokens, parents, depths, sc, pos_off, num


def ancestor_mask(parents: torch.Tensor, max_depth: int, backend: str = "auto") -> torch.Tensor:
    if not use_triton(parents, backend):
        return ancestor_mask_torch(parents, max_depth)
    n, b = parents.shape
    r = b + 1
    mask = torch.empty(n, r, r, dtype=torch.bool, device=parents.device)
    rows = 16
    _mask_kernel[(n, triton.cdiv(r, rows))](
        parents.contiguous(), mask.view(torch.int8), b, r, L=max_depth, ROWS=rows, CP=next_pow2(r), num_warps=4
    )
    return mask


# --------------------------------------------------------------------------- API


def build_tree_from_topk(
    vals: torch.Tensor,
    idx: torch.Tensor,
    budget,
    max_budget: int,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
    with_mask: bool = True,
) -> DDTree:
    """Tree from per-depth top-K candidates: vals [N, L, K] (log-probs, or logits with
    lse [N, L] to subtract), idx [N, L, K] token ids, K = min(max_budget, V)."""
    n, L, k = vals.shape
    if not 1 <= L <= MAX_DEPTH:
        raise ValueError(f"L must be in 1..{MAX_DEPTH}")
    if max_budget < 1:
        raise ValueError("max_budget must be >= 1")
    dev = vals.device
    b = _budget_tensor(budget, n, max_budget, dev)
    if use_triton(vals, backend):
        lse_c = None if lse is None else lse.float().contiguous()
        tokens, parents, depths, scores, pos, num = _core_triton(vals, idx, lse_c, b, max_budget)
    else:
        q, tok = canonical_topk(vals, idx, lse)
        tokens, parents, depths, scores, pos, num = _core_torch(q, tok, b, max_budget)
    mask = ancestor_mask(parents, L, backend) if with_mask else None
    return DDTree(tokens, parents, depths, num, scores, mask, pos, L, max_budget)


def build_tree(
    draft: torch.Tensor,
    budget,
    max_budget: int,
    logprobs: bool = False,
    backend: str = "auto",
    with_mask: bool = True,
    topk: str = "auto",
) -> DDTree:
    """DDTree from drafter logits (or log-probs if logprobs=True) [N, L, V].

    NaN and +-inf entries are excluded tokens (as -inf): they never enter the tree.
    budget: int or LongTensor [N] (clamped to 0..max_budget).  No host sync; on CUDA
    (backend='triton', topk='fused': the defaults there) it is four Triton kernels
    (vocab top-K + lse: 2, tree, mask) plus the budget tensor's fill, and CUDA-graph
    capturable (call once before capture: the candidate tables are cached
    per device).  topk: vocab_topk's impl ('auto', 'fused', 'torch').
    """
    n, L, v = draft.shape
    if v > (1 << TOK_BITS):
        raise ValueError("vocab larger than 2**20 is not supported")
    k = min(max_budget, v)
    # NaN / +-inf from a drafter mean "no usable probability": vocab_topk and its lse
    # treat them as -inf (no extra pass over the logits), so such a token never takes a
    # top-K slot and never enters a tree
    vals, idx, lse = vocab_topk(draft, k, with_lse=not logprobs, impl=topk)
    return build_tree_from_topk(vals, idx, budget, max_budget, lse, backend, with_mask)


def build_chain_from_topk(
    vals: torch.Tensor,
    idx: torch.Tensor,
    max_budget: int,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
    with_mask: bool = True,
) -> DDTree:
    """The drafter's top-1 chain as a DDTree (same fields and pads as build_tree):
    node d - 1 = the depth-d token with the largest value (ties: lower id; DFlash's
    argmax draft), parent = the node before it.  min(L, max_budget) nodes; as in the
    tree build, an excluded token (log-prob -inf/NaN/< LP_MIN) ends the chain.
    vals/idx [N, L, K] in any order, lse [N, L] as for build_tree_from_topk."""
    n, L, k = vals.shape
    dev = vals.device
    m = min(L, max_budget)
    tok, sc, ok = _chain(vals, idx, lse)
    tok, sc, ok = tok[:, :m], sc[:, :m], ok[:, :m]
    pad = max_budget - m
    j = torch.arange(m, device=dev).expand(n, m)
    tokens = _pad_right(torch.where(ok, tok, 0), pad, 0)
    parents = _pad_right(torch.where(ok, j - 1, -1), pad, -1)
    depths = _pad_right(torch.where(ok, j + 1, 0), pad, 0)
    scores = _float_scores(_pad_right(sc, pad, S_NEG))
    pos = torch.cat([torch.zeros(n, 1, dtype=torch.int64, device=dev), depths], 1)
    mask = ancestor_mask(parents, L, backend) if with_mask else None
    return DDTree(tokens, parents, depths, ok.sum(1), scores, mask, pos, L, max_budget)


def chain_scores(vals: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor | None = None):
    """Scores [N, L] (float32 log q, like DDTree.scores) of the top-1 chain's prefixes,
    -inf from the first excluded token on: what the budget controller needs to weigh
    the chain without building it."""
    return _float_scores(_chain(vals, idx, lse)[1])


def top1(vals: torch.Tensor, idx: torch.Tensor):
    """(token ids [N, L] int64, their column [N, L, 1]) of the top-1 per position of a
    kept top-K [N, L, K] in any order: largest value, ties to the lower id (DFlash's
    argmax draft)."""
    best = order_keys(vals, idx).argmax(-1, keepdim=True)
    return idx.gather(-1, best).squeeze(-1).to(torch.int64), best


def _chain(vals, idx, lse):
    """(tokens, int64 prefix scores (S_NEG when excluded), valid) of the top-1 chain."""
    tok, best = top1(vals, idx)
    lp = vals.gather(-1, best).squeeze(-1).float()
    q = quantize_logprobs(lp if lse is None else lp - lse.float())
    ok = torch.cumprod((q > Q_NEG).to(torch.int64), 1) > 0
    sc = torch.cumsum(torch.where(ok, q, 0), 1)
    return tok, torch.where(ok, sc, S_NEG), ok


def _pad_right(x: torch.Tensor, n: int, value) -> torch.Tensor:
    """Pad the last dim on the right with n copies of value."""
    return torch.nn.functional.pad(x, (0, n), value=value) if n else x


@functools.lru_cache(maxsize=None)
def num_candidates(bmax: int) -> int:
    """Candidate pairs per depth for max_budget bmax (~ bmax ln bmax)."""
    return sum(bmax // (i + 1) for i in range(bmax))
