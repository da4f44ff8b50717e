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

from . import gdn_triton
from ._triton import use_triton
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
# the kernels live in gdn_triton.py; these run them on [N, T, ...] tensors


def _rows(n: int, t: int, dev) -> torch.Tensor:
    return torch.arange(n * t, device=dev).view(n, t)


def _tree_conv1d_triton(x, hist, weight, bias, windows, silu):
    n, t, c = x.shape
    x = x.contiguous()
    y = torch.empty(n, t, c, dtype=x.dtype, device=x.device)
    return gdn_triton.conv1d(x.view(n * t, c), _rows(n, t, x.device), hist,
                             torch.arange(n, device=x.device), weight, bias, windows, silu,
                             y)


def _verify_triton(q, k, v, g, beta, h0, mask, scale, l2):
    n, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    dev = q.device
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty(n * t, hv, vd, dtype=torch.float32, device=dev)
    stash = GDNStash(torch.empty(n * t, h, kd, dtype=torch.float32, device=dev),
                     torch.empty(n * t, hv, vd, dtype=torch.float32, device=dev),
                     torch.empty(n * t, hv, dtype=torch.float32, device=dev))
    rows = _rows(n, t, dev)
    gdn_triton.verify(q, k, v, g.reshape(n * t, hv).contiguous(),
                      beta.reshape(n * t, hv).contiguous(), rows,
                      mask.contiguous().view(torch.int8), h0, torch.arange(n, device=dev),
                      o, rows, stash, rows, scale, l2=l2)
    return o.view(n, t, hv, vd), GDNStash(stash.k.view(n, t, h, kd),
                                          stash.u.view(n, t, hv, vd), stash.G.view(n, t, hv))


def _commit_triton(h0, stash, accepted_rows, num_accepted, out):
    n, t = stash.G.shape[:2]
    out = torch.empty_like(h0) if out is None else out
    flat = GDNStash(*(x.reshape(n * t, *x.shape[2:]) for x in stash))
    gdn_triton.commit(h0, torch.arange(n, device=h0.device), flat,
                      torch.arange(n, device=h0.device) * t,
                      accepted_rows.clamp(min=0), num_accepted, out=out)
    return out
