"""Gated DeltaNet (GDN) layers on a DDTree: verify every node from the committed state,
then advance the state along the accepted path.

Verify rows as everywhere in core: row 0 = root, row r = node r - 1; ``parents``
[N, B] are DDTree node parents (-1 = child of the root).  T = B + 1 rows.

The recurrence (vLLM's ``fused_sigmoid_gating_delta_rule_update``), per value head,
state S [K, V]:
    g = -exp(A_log) * softplus(a + dt_bias)     beta = sigmoid(b)      (gdn_gates)
    q, k <- x * rsqrt(sum(x^2) + 1e-6);  q <- q * scale
    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q
On a tree, a node's S comes from its parent's S.  With G_t = sum of g over the
ancestors-or-self of t, unrolling gives the tree-masked chunked (WY) form:
    u_t = beta_t (v_t - e^{G_t} h0^T k_t - sum_{s anc t} e^{G_t - G_s} (k_s.k_t) u_s)
    o_t = e^{G_t} h0^T q_t + sum_{s anc-or-self t} e^{G_t - G_s} (k_s.q_t) u_s
i.e. one unit lower-triangular solve (ancestor mask instead of the causal mask) and
one masked Q K^T, from the committed state h0.  Nothing per node but the stash
(k, u, G) is kept; the commit rebuilds the state at the last accepted node a:
    S_a = e^{G_a} h0 + sum_{s on the path} e^{G_a - G_s} k_s u_s^T.
Query heads: value head hv reads key head hv // (HV // H) (GQA, as vLLM).

Short convolution (width W, 4 in Qwen3-Next/3.5): a node's window is
[ancestor W-1, ..., parent, self], taken from the committed history (the last W-1
inputs, oldest first) where the tree is shallower.  ``conv_windows`` gives, per row,
indices into the extended sequence [history (W-1), x rows (T)]; the new history after
the walk is the last accepted row's window without its oldest entry.

API (torch everywhere; Triton on CUDA or under TRITON_INTERPRET=1, backend as in
the rest of core):
  gdn_gates(a, b, A_log, dt_bias) -> (g, beta) float32
  conv_windows(parents, width) -> [N, T, W] int64
  tree_conv1d(x [N,T,C], hist [N,C,W-1], weight [C,W], bias, windows, silu) -> [N,T,C]
  conv_commit(x, hist, windows, accepted_rows, num_accepted) -> new hist [N,C,W-1]
  tree_gdn_verify(q, k, v, g, beta, h0, mask, scale) -> (o [N,T,HV,V], GDNStash)
  tree_gdn_commit(h0, stash, accepted_rows, num_accepted, out=None) -> S [N,HV,K,V]
  gdn_chain / tree_gdn_reference: plain recurrences (float64 oracles; per-node
  states in depth order for the tree, method (a)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, next_pow2, tl, triton, use_triton
from .tree_build import ancestor_mask

L2_EPS = 1e-6


class GDNStash(NamedTuple):
    """What the commit needs per node: k (l2-normalised, per key head) [N,T,H,K],
    u (the solved pseudo-values) [N,T,HV,V] and G (gate summed along the path)
    [N,T,HV], all float32."""

    k: torch.Tensor
    u: torch.Tensor
    G: torch.Tensor


def gdn_gates(a, b, A_log, dt_bias, threshold: float = 20.0):
    """vLLM's gating: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    x = a.float() + dt_bias.float()
    sp = torch.where(x <= threshold, torch.log1p(torch.exp(x)), x)
    return -torch.exp(A_log.float()) * sp, torch.sigmoid(b.float())


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def row_parents(parents: torch.Tensor) -> torch.Tensor:
    """Node parents [N, B] -> verify-row parents [N, B+1] (-1 for the root row)."""
    n = parents.shape[0]
    root = torch.full((n, 1), -1, dtype=torch.int64, device=parents.device)
    return torch.cat([root, parents.long() + 1], 1)


def tree_mask(parents: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """[N, T, T] bool ancestor-or-self mask over verify rows (shared by all layers)."""
    return ancestor_mask(parents.long(), parents.shape[1], backend)


# ------------------------------------------------------------------ convolution


def conv_windows(parents: torch.Tensor, width: int) -> torch.Tensor:
    """[N, T, W] int64: indices into [history (W-1 columns), rows (T)] of each row's
    window, oldest first, self last.  History column c (c = W-2 is the newest) stands
    before the root."""
    prow = row_parents(parents)
    n, t = prow.shape
    h = width - 1
    # extended parent map over [history, rows]: row r -> h + parent, root -> h - 1,
    # history column c -> c - 1 (column 0 is never walked past: windows are W long)
    ext = torch.cat([torch.arange(-1, h - 1, device=prow.device).expand(n, h),
                     torch.where(prow >= 0, prow + h, h - 1)], 1)
    cur = torch.arange(h, h + t, device=prow.device).expand(n, t)
    cols = [cur]
    for _ in range(h):
        cur = ext.gather(1, cur.clamp(min=0))
        cols.append(cur)
    return torch.stack(cols[::-1], 2)


def _extended(x: torch.Tensor, hist: torch.Tensor) -> torch.Tensor:
    return torch.cat([hist.transpose(1, 2).to(x.dtype), x], 1)  # [N, W-1+T, C]


def tree_conv1d(x, hist, weight, bias, windows, silu: bool = True, backend: str = "auto"):
    """Causal depthwise conv along each row's ancestor chain.  x [N, T, C] (the
    projected inputs), hist [N, C, W-1], weight [C, W]; returns [N, T, C] in x.dtype
    (accumulated in float32, or float64 for float64 x)."""
    if use_triton(x, backend):
        return _tree_conv1d_triton(x, hist, weight, bias, windows, silu)
    dt = torch.promote_types(x.dtype, torch.float32)
    ext = _extended(x.to(dt), hist.to(dt))
    n, t, w = windows.shape
    win = ext.gather(1, windows.reshape(n, t * w, 1).expand(-1, -1, ext.shape[2]))
    win = win.view(n, t, w, -1)
    y = torch.einsum("ntwc,cw->ntc", win, weight.to(dt))
    if bias is not None:
        y = y + bias.to(dt)
    return (F.silu(y) if silu else y).to(x.dtype)


def conv_commit(x, hist, windows, accepted_rows, num_accepted) -> torch.Tensor:
    """New history [N, C, W-1] after the walk: the last W-1 inputs along the path."""
    n = x.shape[0]
    last = accepted_rows.long().gather(1, num_accepted.long().view(n, 1))  # [N, 1]
    idx = windows.gather(1, last.view(n, 1, 1).expand(-1, 1, windows.shape[2]))[:, 0, 1:]
    ext = _extended(x, hist)
    new = ext.gather(1, idx.unsqueeze(2).expand(-1, -1, ext.shape[2]))
    return new.transpose(1, 2).to(hist.dtype)


# ------------------------------------------------------------------ recurrence


def _heads(q, k, hv: int):
    r = hv // q.shape[2]
    return q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)


def gdn_chain(q, k, v, g, beta, h0, scale: float, l2: bool = True):
    """The plain recurrence over a linear sequence (vLLM's kernel, step by step) in
    the inputs' dtype.  q, k [N,T,H,K]; v [N,T,HV,V]; g, beta [N,T,HV]; h0
    [N,HV,K,V].  Returns (o [N,T,HV,V], states after each token [N,T,HV,K,V])."""
    if l2:
        q, k = l2norm(q), l2norm(k)
    q, k = _heads(q * scale, k, v.shape[2])
    s = h0.clone()
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * torch.exp(g[:, t])[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhkv,nhk->nhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", s, q[:, t]))
        states.append(s)
    return torch.stack(outs, 1), torch.stack(states, 1)


def tree_gdn_reference(q, k, v, g, beta, h0, parents, scale: float, l2: bool = True):
    """Method (a): one state per node, in row order (parents first); each node is a
    one-token step from its parent's state.  Returns (o, states [N,T,HV,K,V])."""
    prow = row_parents(parents)
    if l2:
        q, k = l2norm(q), l2norm(k)
    q, k = _heads(q * scale, k, v.shape[2])
    n, t = prow.shape
    ar = torch.arange(n, device=q.device)
    states = torch.empty(n, t, *h0.shape[1:], dtype=h0.dtype, device=h0.device)
    outs = torch.empty(n, t, *v.shape[2:], dtype=v.dtype, device=v.device)
    for r in range(t):
        par = prow[:, r]
        s = torch.where((par >= 0)[:, None, None, None], states[ar, par.clamp(min=0)], h0)
        s = s * torch.exp(g[:, r])[..., None, None]
        u = beta[:, r, :, None] * (v[:, r] - torch.einsum("nhkv,nhk->nhv", s, k[:, r]))
        s = s + k[:, r, :, :, None] * u[:, :, None, :]
        states[:, r] = s
        outs[:, r] = torch.einsum("nhkv,nhk->nhv", s, q[:, r])
    return outs, states


def tree_gdn_verify(q, k, v, g, beta, h0, mask, scale: float, l2: bool = True,
                    backend: str = "auto"):
    """Outputs of every tree row from the committed state h0, by the tree-masked
    chunked delta rule.  q, k [N,T,H,K]; v [N,T,HV,V]; g, beta [N,T,HV] float32;
    h0 [N,HV,K,V]; mask [N,T,T] (tree_mask).  Returns (o [N,T,HV,V] float32,
    GDNStash).  Computed in float32 (float64 inputs: float64)."""
    if use_triton(q, backend):
        return _verify_triton(q, k, v, g, beta, h0, mask, scale, l2)
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta, h0 = (x.to(dt) for x in (q, k, v, g, beta, h0))
    if l2:
        q, k = l2norm(q), l2norm(k)
    kn = k
    q, k = _heads(q * scale, k, v.shape[2])
    m = mask.unsqueeze(1)  # [N, 1, T, T]
    G = torch.einsum("nts,nsh->nth", mask.to(dt), g)  # along the path
    Gh = G.transpose(1, 2)  # [N, HV, T]
    diff = (Gh.unsqueeze(3) - Gh.unsqueeze(2)).masked_fill(~m, float("-inf"))
    decay = torch.exp(diff)  # [N, HV, T(t), T(s)]: e^{G_t - G_s} on anc-or-self, else 0
    kk = torch.einsum("nthk,nshk->nhts", k, k)
    eye = torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device)
    a = (decay * kk).masked_fill(eye, 0.0) * beta.transpose(1, 2).unsqueeze(3)
    eg = torch.exp(Gh).unsqueeze(3)  # [N, HV, T, 1]
    kh = torch.einsum("nthk,nhkv->nhtv", k, h0)
    rhs = beta.transpose(1, 2).unsqueeze(3) * (v.transpose(1, 2) - eg * kh)
    u = torch.linalg.solve_triangular(a + torch.eye(a.shape[-1], dtype=dt, device=a.device),
                                      rhs, upper=False, unitriangular=True)
    qk = torch.einsum("nthk,nshk->nhts", q, k) * decay
    o = eg * torch.einsum("nthk,nhkv->nhtv", q, h0) + qk @ u
    return o.transpose(1, 2), GDNStash(kn, u.transpose(1, 2).contiguous(), G)


def tree_gdn_commit(h0, stash: GDNStash, accepted_rows, num_accepted, out=None,
                    backend: str = "auto"):
    """State at the last accepted row: e^{G_a} h0 + sum_path e^{G_a - G_s} k_s u_s^T.
    accepted_rows [N, L+1] (0 first, -1 pads), num_accepted [N].  Writes into
    ``out`` (any strides, e.g. a view of the state cache) when given; returns it."""
    if use_triton(h0, backend):
        return _commit_triton(h0, stash, accepted_rows, num_accepted, out)
    n, l1 = accepted_rows.shape
    hv = stash.u.shape[2]
    j = torch.arange(l1, device=h0.device)
    on = j[None, :] <= num_accepted.long()[:, None]  # [N, L+1]
    rows = torch.where(on, accepted_rows.long(), 0)
    G = stash.G.gather(1, rows[:, :, None].expand(-1, -1, hv))  # [N, L+1, HV]
    Ga = stash.G.gather(1, rows.gather(1, num_accepted.long()[:, None]).unsqueeze(2)
                        .expand(-1, 1, hv))  # [N, 1, HV]
    w = torch.exp(Ga - G) * on[:, :, None]
    r = hv // stash.k.shape[2]
    k = stash.k.gather(1, rows[:, :, None, None].expand(-1, -1, *stash.k.shape[2:]))
    k = k.repeat_interleave(r, 2)
    u = stash.u.gather(1, rows[:, :, None, None].expand(-1, -1, *stash.u.shape[2:]))
    s = torch.exp(Ga[:, 0])[..., None, None] * h0.to(k.dtype) + torch.einsum(
        "njh,njhk,njhv->nhkv", w, k, u)
    if out is None:
        return s.to(h0.dtype)
    out.copy_(s)
    return out


# ------------------------------------------------------------------ triton

if HAS_TRITON:

    @triton.jit
    def _conv_kernel(x_ptr, h_ptr, w_ptr, b_ptr, win_ptr, y_ptr,
                     T, C, sxn, sxt, shn, shc, shw, swc, sww, syn, syt,
                     W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     BC: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1).to(tl.int64)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        cm = c < C
        acc = tl.zeros([BC], dtype=tl.float32)
        for w in tl.static_range(W):
            e = tl.load(win_ptr + (n * T + t) * W + w)
            # a history column, else row e - (W - 1)
            val = tl.load(h_ptr + n * shn + c * shc + e * shw, mask=cm & (e < W - 1),
                          other=0.0)
            val += tl.load(x_ptr + n * sxn + (e - (W - 1)) * sxt + c,
                           mask=cm & (e >= W - 1), other=0.0)
            acc += val.to(tl.float32) * tl.load(w_ptr + c * swc + w * sww, mask=cm,
                                                other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + n * syn + t * syt + c, acc.to(y_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _verify_kernel(q_ptr, k_ptr, v_ptr, G_ptr, b_ptr, h0_ptr, m_ptr, o_ptr, u_ptr,
                       HV, H, svn, svt, svh, shn, shh, shk, shv, T: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr,
                       BV: tl.constexpr):
        # One program per (request, value head, V block); q, k are normalised and
        # scaled, G summed along the path (contiguous float32).  Rows go in chunks of
        # BC, parents first: a chunk's u needs only earlier rows (block forward
        # substitution); inside the chunk the solve runs row by row in registers.
        # u of earlier chunks is read back from u_ptr (this program wrote it).  Loop
        # bounds are compile-time (T = B + 1 is fixed per engine): the interpreter
        # takes no runtime bounds.
        n = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        ov = tl.program_id(2) * BV + tl.arange(0, BV)
        ovm = ov < V
        kh = hv // (HV // H)
        ok = tl.arange(0, K)
        oc = tl.arange(0, BC)
        h0 = tl.load(h0_ptr + n * shn + hv * shh + ok[:, None] * shk + ov[None, :] * shv,
                     mask=ovm[None, :], other=0.0).to(tl.float32)  # [K, BV]
        for c0 in range(0, T, BC):
            rc = c0 + oc
            rm = rc < T
            kc = tl.load(k_ptr + ((n * T + rc[:, None]) * H + kh) * K + ok[None, :],
                         mask=rm[:, None], other=0.0)
            qc = tl.load(q_ptr + ((n * T + rc[:, None]) * H + kh) * K + ok[None, :],
                         mask=rm[:, None], other=0.0)
            Gc = tl.load(G_ptr + (n * T + rc) * HV + hv, mask=rm, other=0.0)
            bc = tl.load(b_ptr + (n * T + rc) * HV + hv, mask=rm, other=0.0)
            vc = tl.load(v_ptr + n * svn + rc[:, None] * svt + hv * svh + ov[None, :],
                         mask=rm[:, None] & ovm[None, :], other=0.0).to(tl.float32)
            eg = tl.exp(Gc)
            r = bc[:, None] * (vc - eg[:, None] * tl.dot(kc, h0, input_precision="ieee"))
            o = eg[:, None] * tl.dot(qc, h0, input_precision="ieee")
            for p0 in range(0, c0, BC):  # earlier chunks (all rows valid)
                rp = p0 + oc
                mp = tl.load(m_ptr + (n * T + rc[:, None]) * T + rp[None, :],
                             mask=rm[:, None], other=0) != 0
                Gp = tl.load(G_ptr + (n * T + rp) * HV + hv)
                kp = tl.load(k_ptr + ((n * T + rp[:, None]) * H + kh) * K + ok[None, :])
                up = tl.load(u_ptr + ((n * T + rp[:, None]) * HV + hv) * V + ov[None, :],
                             mask=ovm[None, :], other=0.0)
                dec = tl.where(mp, tl.exp(Gc[:, None] - Gp[None, :]), 0.0)
                kk = tl.dot(kc, tl.trans(kp), input_precision="ieee")
                qk = tl.dot(qc, tl.trans(kp), input_precision="ieee")
                r -= bc[:, None] * tl.dot(dec * kk, up, input_precision="ieee")
                o += tl.dot(dec * qk, up, input_precision="ieee")
            md = tl.load(m_ptr + (n * T + rc[:, None]) * T + rc[None, :],
                         mask=rm[:, None] & rm[None, :], other=0) != 0
            dd = tl.where(md, tl.exp(Gc[:, None] - Gc[None, :]), 0.0)
            kk = tl.dot(kc, tl.trans(kc), input_precision="ieee")
            a = tl.where(oc[:, None] > oc[None, :], dd * kk, 0.0) * bc[:, None]
            u = r  # (I + A) u = r, A strictly lower
            for i in range(BC):
                sel = oc[:, None] == i
                ai = tl.sum(tl.where(sel, a, 0.0), 0)
                ui = tl.sum(tl.where(sel, r, 0.0), 0) - tl.sum(ai[:, None] * u, 0)
                u = tl.where(sel, ui[None, :], u)
            o += tl.dot(dd * tl.dot(qc, tl.trans(kc), input_precision="ieee"), u,
                        input_precision="ieee")
            tl.store(u_ptr + ((n * T + rc[:, None]) * HV + hv) * V + ov[None, :], u,
                     mask=rm[:, None] & ovm[None, :])
            tl.store(o_ptr + ((n * T + rc[:, None]) * HV + hv) * V + ov[None, :], o,
                     mask=rm[:, None] & ovm[None, :])
            tl.debug_barrier()  # this chunk's u is read by the next ones

    @triton.jit
    def _commit_kernel(h0_ptr, k_ptr, u_ptr, G_ptr, rows_ptr, na_ptr, out_ptr,
                       T, HV, H, shn, shh, shk, shv, son, soh, sok, sov,
                       L1: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BV: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        ov = tl.program_id(2) * BV + tl.arange(0, BV)
        ovm = ov < V
        ok = tl.arange(0, K)
        kh = hv // (HV // H)
        a = tl.load(na_ptr + n)
        last = tl.load(rows_ptr + n * L1 + a)
        Ga = tl.load(G_ptr + (n * T + last) * HV + hv)
        s = tl.exp(Ga) * tl.load(h0_ptr + n * shn + hv * shh + ok[:, None] * shk +
                                 ov[None, :] * shv, mask=ovm[None, :], other=0.0).to(tl.float32)
        for j in range(L1):
            on = j <= a
            r = tl.load(rows_ptr + n * L1 + j, mask=on, other=0)
            w = tl.where(on, tl.exp(Ga - tl.load(G_ptr + (n * T + r) * HV + hv)), 0.0)
            kr = tl.load(k_ptr + ((n * T + r) * H + kh) * K + ok)
            ur = tl.load(u_ptr + ((n * T + r) * HV + hv) * V + ov, mask=ovm, other=0.0)
            s += w * kr[:, None] * ur[None, :]
        tl.store(out_ptr + n * son + hv * soh + ok[:, None] * sok + ov[None, :] * sov,
                 s.to(out_ptr.dtype.element_ty), mask=ovm[None, :])


def _tree_conv1d_triton(x, hist, weight, bias, windows, silu):
    n, t, c = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty(n, t, c, dtype=x.dtype, device=x.device)
    bc = min(256, next_pow2(c))
    _conv_kernel[(n, t, triton.cdiv(c, bc))](
        x, hist, weight, bias if bias is not None else weight, windows.contiguous(), y,
        t, c, x.stride(0), x.stride(1), *hist.stride(), *weight.stride(),
        y.stride(0), y.stride(1), W=weight.shape[1], HAS_BIAS=bias is not None,
        SILU=silu, BC=bc)
    return y


# the verify kernel's launch: rows per chunk (bc) and the V block of a program (bv;
# None: min(64, V)).  bench/gpu/gdn_bench.py --blocks sweeps them (run 13: 274 us per
# layer in the Qwen3.6-27B engine at B = 16 with the defaults, 96 programs at one request)
VERIFY_BLOCKS = {"bc": 16, "bv": None}


def _verify_triton(q, k, v, g, beta, h0, mask, scale, l2):
    n, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    if kd != next_pow2(kd) or kd < 16 or vd < 16:
        raise NotImplementedError(f"tree GDN kernel: head sizes K={kd}, V={vd} (K a "
                                  "power of 2, both >= 16)")
    q, k = q.float(), k.float()
    if l2:
        q, k = l2norm(q), l2norm(k)
    q, k = (q * scale).contiguous(), k.contiguous()
    G = torch.einsum("nts,nsh->nth", mask.float(), g.float()).contiguous()
    beta = beta.float().contiguous()
    o = torch.empty(n, t, hv, vd, dtype=torch.float32, device=q.device)
    u = torch.empty_like(o)
    bv = min(VERIFY_BLOCKS["bv"] or 64, next_pow2(vd))
    _verify_kernel[(n, hv, triton.cdiv(vd, bv))](
        q, k, v, G, beta, h0, mask.contiguous().view(torch.int8), o, u, hv, h,
        v.stride(0), v.stride(1), v.stride(2), *h0.stride(), T=t, K=kd, V=vd,
        BC=VERIFY_BLOCKS["bc"], BV=bv)
    return o, GDNStash(k, u, G)


def _commit_triton(h0, stash, accepted_rows, num_accepted, out):
    n, hv, kd, vd = h0.shape
    t, h = stash.k.shape[1], stash.k.shape[2]
    if out is None:
        out = torch.empty_like(h0)
    bv = min(64, next_pow2(vd))
    rows = accepted_rows.to(torch.int64).contiguous()
    _commit_kernel[(n, hv, triton.cdiv(vd, bv))](
        h0, stash.k, stash.u, stash.G, rows, num_accepted.to(torch.int64).contiguous(), out,
        t, hv, h, *h0.stride(), *out.stride(), L1=rows.shape[1], K=kd, V=vd, BV=bv)
    return out
