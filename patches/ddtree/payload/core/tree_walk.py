"""Tree walk (verification) over the verify rows of a DDTree.

Verify rows: row 0 = root (the last accepted / bonus token), row r = node r - 1.
Children of row r: nodes with parent == r - 1, in node order (pop order).

Greedy: at the current row take t = argmax of the target there; if a child has
token t, accept it and move there, else t is the bonus token.  (Nodes at depth L
have no children, so the walk ends there with the argmax as bonus.)

Sampled (lossless, target-only; DESIGN.md section 5), exact integer form:
  * masses m(v) = floor(max(p(v), 0) * 2**40) as int64 (p float, need not sum to
    exactly 1); T = sum_v m(v) over the row; one uniform u in [0, 1) per visited
    row j (uniforms[:, j]); t = min(int64(float64(u) * float64(T)), T - 1).
  * inverse CDF over the order "children in node order, then every other token in
    id order": if t < C_k (inclusive prefix sum of the children's masses) for some
    k, move to the first such child; else the bonus token is the first non-child
    v (id order) whose inclusive prefix mass over non-children exceeds t - C_m.
  This draws exactly from m / T at each row, so the emitted tokens follow the
  target's autoregressive distribution (up to the 2**-40 mass quantisation).
  Integer sums make torch and Triton bit-identical whatever the summation order:
  the Triton path first sums every row's masses per 4096-token chunk in parallel
  (one pass over the probs, like the softmax that made them), then walks; the
  bonus token scans one chunk.

Outputs (vLLM rejection-sampler format): accepted_rows [N, L+1] (row 0 first, -1
pad), output_tokens [N, L+1] (accepted draft tokens, then the bonus, -1 pad),
num_accepted [N] (draft tokens accepted, bonus excluded).
"""

from typing import NamedTuple

import torch

from ._triton import HAS_TRITON, next_pow2, tl, triton, use_triton

MASS_BITS = 40
MASS_SCALE = float(1 << MASS_BITS)
SUM_CHUNK = 4096  # tokens per chunk of the row-mass pre-pass (power of 2)


class WalkResult(NamedTuple):
    accepted_rows: torch.Tensor  # [N, L+1] int64
    output_tokens: torch.Tensor  # [N, L+1] int64
    num_accepted: torch.Tensor  # [N] int64

    def emitting_rows(self, width: int) -> torch.Tensor:
        """[N, width] int64: the verify row that emitted output token j (its logprobs
        come from there); 0 past the path (never emitted)."""
        acc = self.accepted_rows[:, :width].clamp(min=0)
        if acc.shape[1] < width:
            acc = torch.cat([acc, acc.new_zeros(acc.shape[0], width - acc.shape[1])], 1)
        return acc


def masses(p: torch.Tensor) -> torch.Tensor:
    """float probabilities -> int64 fixed-point masses (units 2**-40)."""
    p = p.float()
    return (torch.where(p > 0, p, torch.zeros_like(p)) * MASS_SCALE).to(torch.int64)


def _init_out(n, L, dev):
    rows = torch.full((n, L + 1), -1, dtype=torch.int64, device=dev)
    rows[:, 0] = 0
    toks = torch.full((n, L + 1), -1, dtype=torch.int64, device=dev)
    return rows, toks, torch.zeros(n, dtype=torch.int64, device=dev)


def _node_views(tree):
    bmax = tree.tokens.shape[1]
    dev = tree.tokens.device
    valid = torch.arange(bmax, device=dev).unsqueeze(0) < tree.num_nodes.unsqueeze(1)
    return tree.parents, tree.tokens, valid


# --------------------------------------------------------------------------- torch


def walk_greedy_torch(argmax: torch.Tensor, tree) -> WalkResult:
    n = argmax.shape[0]
    L = tree.max_depth
    dev = argmax.device
    par, tok, valid = _node_views(tree)
    rows, toks, nacc = _init_out(n, L, dev)
    ar = torch.arange(n, device=dev)
    cur = torch.zeros(n, dtype=torch.int64, device=dev)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    am = argmax.long()
    for step in range(L + 1):
        t = am[ar, cur]
        match = valid & (par == (cur - 1).unsqueeze(1)) & (tok == t.unsqueeze(1))
        if step == L:
            match = torch.zeros_like(match)
        found = match.any(1) & ~done
        c = match.int().argmax(1)
        act = ~done
        toks[:, step] = torch.where(act, t, toks[:, step])
        rows[:, min(step + 1, L)] = torch.where(found, c + 1, rows[:, min(step + 1, L)])
        nacc += found.long()
        cur = torch.where(found, c + 1, cur)
        done |= act & ~found
    return WalkResult(rows, toks, nacc)


def walk_sampled_torch(probs: torch.Tensor, tree, uniforms: torch.Tensor) -> WalkResult:
    n, _, v = probs.shape
    L = tree.max_depth
    dev = probs.device
    par, tok, valid = _node_views(tree)
    rows, toks, nacc = _init_out(n, L, dev)
    ar = torch.arange(n, device=dev)
    cur = torch.zeros(n, dtype=torch.int64, device=dev)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    brow = torch.zeros_like(cur)
    bt = torch.zeros_like(cur)
    for step in range(L + 1):
        prow = probs[ar, cur]
        T = masses(prow).sum(1)
        t = (uniforms[:, step].double() * T.double()).to(torch.int64)
        t = torch.minimum(t, T - 1).clamp(min=0)
        child = valid & (par == (cur - 1).unsqueeze(1))
        if step == L:
            child = torch.zeros_like(child)
        cm = torch.where(child, masses(prow.gather(1, tok)), 0)
        C = torch.cumsum(cm, 1)
        acc = child & (t.unsqueeze(1) < C)
        found = acc.any(1) & ~done
        c = acc.int().argmax(1)
        stop = ~done & ~found
        toks[:, step] = torch.where(found, tok[ar, c], toks[:, step])
        rows[:, min(step + 1, L)] = torch.where(found, c + 1, rows[:, min(step + 1, L)])
        brow = torch.where(stop, cur, brow)
        bt = torch.where(stop, t - C[:, -1], bt)
        nacc += found.long()
        cur = torch.where(found, c + 1, cur)
        done |= stop
    m = masses(probs[ar, brow])
    child = valid & (par == (brow - 1).unsqueeze(1))
    m = torch.cat([m, torch.zeros(n, 1, dtype=m.dtype, device=dev)], 1)
    m.scatter_(1, torch.where(child, tok, v), 0)
    cum = torch.cumsum(m[:, :v], 1)
    x = torch.searchsorted(cum, bt.unsqueeze(1), right=True).squeeze(1).clamp(max=v - 1)
    toks[ar, nacc] = x
    return WalkResult(rows, toks, nacc)


# --------------------------------------------------------------------------- triton

if HAS_TRITON:

    @triton.jit
    def _walk_greedy_kernel(am_ptr, s_an, s_ar, tok_ptr, par_ptr, num_ptr, rows_ptr, out_ptr, nacc_ptr,
                            BMAX, L: tl.constexpr, BP: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BP)
        jm = j < BMAX
        num = tl.load(num_ptr + n)
        par = tl.load(par_ptr + n * BMAX + j, mask=jm, other=-2)
        tk = tl.load(tok_ptr + n * BMAX + j, mask=jm, other=0)
        valid = jm & (j < num)
        cur = tl.zeros([], tl.int64)
        nacc = tl.zeros([], tl.int64)
        done = tl.zeros([], tl.int32)
        for step in range(0, L + 1):
            if done == 0:
                t = tl.load(am_ptr + n * s_an + cur * s_ar).to(tl.int64)
                match = valid & (par == cur - 1) & (tk == t) & (step < L)
                c = tl.min(tl.where(match, j, BP), 0).to(tl.int64)
                tl.store(out_ptr + n * (L + 1) + step, t)
                if c < BP:
                    tl.store(rows_ptr + n * (L + 1) + step + 1, c + 1)
                    nacc += 1
                    cur = c + 1
                else:
                    done = 1
        tl.store(nacc_ptr + n, nacc)

    @triton.jit
    def _mass_sums_kernel(p_ptr, s_pn, s_pr, s_pv, out_ptr, R, V, NCH, CH: tl.constexpr):
        # chunk sums of the integer masses of every verify row, all in parallel
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        n = row // R
        r = row % R
        v = c * CH + tl.arange(0, CH)
        p = tl.load(p_ptr + n * s_pn + r * s_pr + v * s_pv, mask=v < V, other=0.0).to(tl.float32)
        m = (tl.where(p > 0, p, 0.0) * 1099511627776.0).to(tl.int64)
        tl.store(out_ptr + row * NCH + c, tl.sum(m, 0))

    @triton.jit
    def _walk_sampled_kernel(p_ptr, s_pn, s_pr, s_pv, u_ptr, s_un, s_us, sums_ptr, tok_ptr, par_ptr, num_ptr,
                             flag_ptr, rows_ptr, out_ptr, nacc_ptr, BMAX, R, V, NCH,
                             L: tl.constexpr, BP: tl.constexpr, CH: tl.constexpr, NCHP: tl.constexpr,
                             KB: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        SCALE: tl.constexpr = 1099511627776.0  # 2**40
        j = tl.arange(0, BP)
        jm = j < BMAX
        num = tl.load(num_ptr + n)
        par = tl.load(par_ptr + n * BMAX + j, mask=jm, other=-2)
        tk = tl.load(tok_ptr + n * BMAX + j, mask=jm, other=0)
        valid = jm & (j < num)
        ch = tl.arange(0, NCHP)
        chm = ch < NCH
        cur = tl.zeros([], tl.int64)
        nacc = tl.zeros([], tl.int64)
        done = tl.zeros([], tl.int32)
        brow = tl.zeros([], tl.int64)
        bt = tl.zeros([], tl.int64)
        for step in range(0, L + 1):
            if done == 0:
                row = p_ptr + n * s_pn + cur * s_pr
                tot = tl.sum(tl.load(sums_ptr + (n * R + cur) * NCH + ch, mask=chm, other=0), 0)
                u = tl.load(u_ptr + n * s_un + step * s_us).to(tl.float64)
                t = (u * tot.to(tl.float64)).to(tl.int64)
                t = tl.maximum(tl.minimum(t, tot - 1), 0)
                child = valid & (par == cur - 1) & (step < L)
                pc = tl.load(row + tk * s_pv, mask=child, other=0.0).to(tl.float32)
                cm = tl.where(child, (tl.where(pc > 0, pc, 0.0) * SCALE).to(tl.int64), 0)
                C = tl.cumsum(cm, 0)
                c = tl.min(tl.where(child & (t < C), j, BP), 0).to(tl.int64)
                if c < BP:
                    tl.store(out_ptr + n * (L + 1) + step, tl.sum(tl.where(j == c, tk, 0), 0))
                    tl.store(rows_ptr + n * (L + 1) + step + 1, c + 1)
                    nacc += 1
                    cur = c + 1
                else:
                    brow = cur
                    bt = t - tl.sum(cm, 0)
                    done = 1
        # bonus: inverse CDF over the non-children of brow in token-id order:
        # find the chunk from the chunk sums minus the children's masses, then scan it
        row = p_ptr + n * s_pn + brow * s_pr
        child = valid & (par == brow - 1)
        tl.store(flag_ptr + n * V + tk, tl.full([BP], 1, tl.int8), mask=child)
        sub = tl.zeros([NCHP], tl.int64)  # children's mass per chunk, KB nodes at a time
        for k0 in range(0, BP, KB):
            kk = k0 + tl.arange(0, KB)
            km = (kk < BMAX) & (kk < num)
            kp = tl.load(par_ptr + n * BMAX + kk, mask=km, other=-2)
            kt = tl.load(tok_ptr + n * BMAX + kk, mask=km, other=0)
            kc = km & (kp == brow - 1)
            pc = tl.load(row + kt * s_pv, mask=kc, other=0.0).to(tl.float32)
            cm = tl.where(kc, (tl.where(pc > 0, pc, 0.0) * SCALE).to(tl.int64), 0)
            sub += tl.sum(tl.where((kt // CH)[None, :] == ch[:, None], cm[None, :], 0), 1)
        ns = tl.load(sums_ptr + (n * R + brow) * NCH + ch, mask=chm, other=0) - sub
        cum = tl.cumsum(ns, 0)
        cstar = tl.min(tl.where(chm & (cum > bt), ch, NCHP), 0)
        base = tl.sum(tl.where(ch == cstar, cum - ns, 0), 0)
        tl.debug_barrier()
        v = cstar * CH + tl.arange(0, CH)
        vm = (v < V) & (cstar < NCHP)
        p = tl.load(row + v * s_pv, mask=vm, other=0.0).to(tl.float32)
        fl = tl.load(flag_ptr + n * V + v, mask=vm, other=1)
        m = tl.where(vm & (fl == 0), (tl.where(p > 0, p, 0.0) * SCALE).to(tl.int64), 0)
        cs = tl.cumsum(m, 0) + base
        best = tl.min(tl.where(vm & (cs > bt), v, V), 0).to(tl.int64)
        best = tl.where(best < V, best, V - 1)
        tl.store(out_ptr + n * (L + 1) + nacc, best)
        tl.store(nacc_ptr + n, nacc)


def _walk_triton(kind, target, tree, uniforms=None):
    n = target.shape[0]
    L = tree.max_depth
    dev = target.device
    bmax = tree.tokens.shape[1]
    rows, toks, nacc = _init_out(n, L, dev)
    tk = tree.tokens.contiguous()
    par = tree.parents.contiguous()
    num = tree.num_nodes.contiguous()
    bp = max(2, next_pow2(bmax))
    if kind == "greedy":
        _walk_greedy_kernel[(n,)](target, target.stride(0), target.stride(1), tk, par, num, rows, toks, nacc,
                                  bmax, L=L, BP=bp, num_warps=4)
    else:
        r, v = target.shape[1], target.shape[2]
        ch = min(SUM_CHUNK, max(2, next_pow2(v)))
        nch = triton.cdiv(v, ch)
        sums = torch.empty(n, r, nch, dtype=torch.int64, device=dev)
        _mass_sums_kernel[(n * r, nch)](target, target.stride(0), target.stride(1), target.stride(2), sums,
                                        r, v, nch, CH=ch, num_warps=4)
        flags = torch.zeros(n, v, dtype=torch.int8, device=dev)
        _walk_sampled_kernel[(n,)](target, target.stride(0), target.stride(1), target.stride(2),
                                   uniforms, uniforms.stride(0), uniforms.stride(1), sums, tk, par, num, flags,
                                   rows, toks, nacc, bmax, r, v, nch, L=L, BP=bp, CH=ch,
                                   NCHP=max(2, next_pow2(nch)), KB=min(bp, 64), num_warps=8)
    return WalkResult(rows, toks, nacc)


# --------------------------------------------------------------------------- API


def walk_greedy(target: torch.Tensor, tree, backend: str = "auto") -> WalkResult:
    """target: argmax token ids [N, B_max+1] (int) or target logits [N, B_max+1, V]."""
    if target.is_floating_point():
        target = target.argmax(-1)
    if use_triton(target, backend):
        return _walk_triton("greedy", target, tree)
    return walk_greedy_torch(target, tree)


def walk_sampled(target_probs: torch.Tensor, tree, uniforms: torch.Tensor, backend: str = "auto") -> WalkResult:
    """target_probs [N, B_max+1, V] (already temperature/top-k/top-p processed, see
    sampling.target_probs); uniforms [N, L+1] in [0, 1), column j used at depth j."""
    if uniforms.shape[1] < tree.max_depth + 1:
        raise ValueError("uniforms must have L + 1 columns")
    if use_triton(target_probs, backend):
        return _walk_triton("sampled", target_probs, tree, uniforms)
    return walk_sampled_torch(target_probs, tree, uniforms)
