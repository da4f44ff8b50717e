"""The tree GDN kernels (Triton): tree conv1d, the tree-masked delta rule, and the
commits of the recurrent state and the conv history.  core/gdn_tree.py holds the math
(and the torch versions these are tested against); gdn/cuda.py launches them on
vLLM's caches in place.

Every kernel reads its inputs and writes its outputs through index tensors, so one
layer's step is two launches (conv, verify) and its commit two more, with no gathers
or scatters around them.  Indices (int64):
  tok  [N, T]  row of x / a / b (the layer's inputs, by token) of each verify row
  slot [N]     state-cache slot of each request (h0 and conv history, read in place)
  orow [N, T]  output row of each verify row (pads: a dump row)
  srow [N, T]  stash row of each verify row (flat buffers; pads: a dump row)
  base [N]     stash row of each request's row 0 (the commits)

The verify inverts the unit lower-triangular (I + A) of the WY form by doubling: A is
nilpotent on a tree (A^d = 0 past the depth), so (I + A)^-1 = prod_j (I + (-A)^(2^j))
over ceil(log2 T) factors, all dots and no row-by-row solve.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, next_pow2, tl, triton

L2_EPS = 1e-6

# launch knobs of the verify: the V block of a program (None: 32) and its warps (None:
# 4 up to 32 rows, else 8).  bench/gpu/gdn_bench.py --blocks sweeps them.
VERIFY_BLOCKS = {"bv": None, "warps": None}

if HAS_TRITON:

    @triton.jit
    def _conv_kernel(x_ptr, sx, tok_ptr, h_ptr, slot_ptr, shs, shc, shw, w_ptr, swc, sww,
                     b_ptr, win_ptr, y_ptr, syn, syt, xs_ptr, sxs, srow_ptr, T, C,
                     W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     COPY_X: tl.constexpr, BC: tl.constexpr):
        # one program per (request, row, channel block); windows index [history, rows]
        n = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1).to(tl.int64)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        cm = c < C
        slot = tl.load(slot_ptr + n)
        acc = tl.zeros([BC], dtype=tl.float32)
        for w in tl.static_range(W):
            e = tl.load(win_ptr + (n * T + t) * W + w)
            hist = e < W - 1
            val = tl.load(h_ptr + slot * shs + c * shc + e * shw, mask=cm & hist, other=0.0)
            tk = tl.load(tok_ptr + n * T + tl.where(hist, 0, e - (W - 1)))
            val = val.to(tl.float32) + tl.load(x_ptr + tk * sx + c, mask=cm & (e >= W - 1),
                                               other=0.0).to(tl.float32)
            acc += val * tl.load(w_ptr + c * swc + w * sww, mask=cm, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + n * syn + t * syt + c, acc.to(y_ptr.dtype.element_ty), mask=cm)
        if COPY_X:  # the row's input, for the conv commit
            tk = tl.load(tok_ptr + n * T + t)
            sr = tl.load(srow_ptr + n * T + t)
            tl.store(xs_ptr + sr * sxs + c, tl.load(x_ptr + tk * sx + c, mask=cm), mask=cm)

    @triton.jit
    def _verify_kernel(q_ptr, k_ptr, v_ptr, sqn, sqt, sqh, svn, svt, svh,
                       a_ptr, b_ptr, sa, sb, tok_ptr, alog_ptr, dtb_ptr, m_ptr,
                       h_ptr, slot_ptr, shs, shh, shk, shv, o_ptr, orow_ptr, sor, soh,
                       sk_ptr, su_ptr, sg_ptr, srow_ptr, skr, sur, sgr, scale, HV, H,
                       T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BV: tl.constexpr, NSQ: tl.constexpr,
                       GATES: tl.constexpr, L2: tl.constexpr):
        # one program per (request, value head, V block); every row of the tree at once
        n = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        kh = hv // (HV // H)
        rt = tl.arange(0, TP)
        rm = rt < T
        ok = tl.arange(0, K)
        q = tl.load(q_ptr + n * sqn + rt[:, None] * sqt + kh * sqh + ok[None, :],
                    mask=rm[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + n * sqn + rt[:, None] * sqt + kh * sqh + ok[None, :],
                    mask=rm[:, None], other=0.0).to(tl.float32)
        if L2:
            q = q * tl.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = q * scale
        tok = tl.load(tok_ptr + n * T + rt, mask=rm, other=0)
        g = tl.load(a_ptr + tok * sa + hv, mask=rm, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + tok * sb + hv, mask=rm, other=0.0).to(tl.float32)
        if GATES:  # vLLM's fused_gdn_gating
            x = g + tl.load(dtb_ptr + hv).to(tl.float32)
            sp = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
            g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * sp
            beta = tl.sigmoid(beta)
        g = tl.where(rm, g, 0.0)
        beta = tl.where(rm, beta, 0.0)
        mk = tl.load(m_ptr + (n * T + rt[:, None]) * T + rt[None, :],
                     mask=rm[:, None] & rm[None, :], other=0) != 0
        G = tl.sum(tl.where(mk, g[None, :], 0.0), 1)  # along the path
        dec = tl.where(mk, tl.exp(G[:, None] - G[None, :]), 0.0)
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        A = tl.where(rt[:, None] > rt[None, :], dec * kk, 0.0) * beta[:, None]
        P = -A
        M = tl.where(rt[:, None] == rt[None, :], 1.0, 0.0) + P
        for _ in tl.static_range(NSQ):  # M = (I - A)(I + A^2)(I + A^4)...
            P = tl.dot(P, P, input_precision="ieee")
            M = M + tl.dot(M, P, input_precision="ieee")
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * dec
        slot = tl.load(slot_ptr + n)
        ov = vb * BV + tl.arange(0, BV)
        ovm = ov < V
        h0 = tl.load(h_ptr + slot * shs + hv * shh + ok[:, None] * shk + ov[None, :] * shv,
                     mask=ovm[None, :], other=0.0).to(tl.float32)  # [K, BV]
        vm = rm[:, None] & ovm[None, :]
        v = tl.load(v_ptr + n * svn + rt[:, None] * svt + hv * svh + ov[None, :], mask=vm,
                    other=0.0).to(tl.float32)
        eg = tl.exp(G)
        r = beta[:, None] * (v - eg[:, None] * tl.dot(k, h0, input_precision="ieee"))
        u = tl.dot(M, r, input_precision="ieee")
        o = eg[:, None] * tl.dot(q, h0, input_precision="ieee") + \
            tl.dot(qk, u, input_precision="ieee")
        orow = tl.load(orow_ptr + n * T + rt, mask=rm, other=0)
        tl.store(o_ptr + orow[:, None] * sor + hv * soh + ov[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=vm)
        srow = tl.load(srow_ptr + n * T + rt, mask=rm, other=0)
        tl.store(su_ptr + srow[:, None] * sur + hv * V + ov[None, :], u, mask=vm)
        first = vb == 0
        tl.store(sg_ptr + srow * sgr + hv, G, mask=rm & first)
        tl.store(sk_ptr + srow[:, None] * skr + kh * K + ok[None, :], k,
                 mask=rm[:, None] & (first & (hv % (HV // H) == 0)))

    @triton.jit
    def _commit_kernel(h_ptr, out_ptr, slot_ptr, shs, shh, shk, shv, sos, soh, sok, sov,
                       sk_ptr, su_ptr, sg_ptr, skr, sur, sgr, base_ptr, rows_ptr, na_ptr,
                       HV, H, L1: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BV: tl.constexpr):
        # S_a = e^{G_a} h0 + sum_path e^{G_a - G_s} k_s u_s^T; in place when out = h
        n = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        ov = tl.program_id(2) * BV + tl.arange(0, BV)
        ovm = ov < V
        ok = tl.arange(0, K)
        kh = hv // (HV // H)
        slot = tl.load(slot_ptr + n)
        base = tl.load(base_ptr + n)
        a = tl.load(na_ptr + n)
        Ga = tl.load(sg_ptr + (base + tl.load(rows_ptr + n * L1 + a)) * sgr + hv)
        s = tl.exp(Ga) * tl.load(h_ptr + slot * shs + hv * shh + ok[:, None] * shk +
                                 ov[None, :] * shv, mask=ovm[None, :], other=0.0).to(tl.float32)
        for j in range(L1):
            on = j <= a
            r = base + tl.load(rows_ptr + n * L1 + j, mask=on, other=0)
            w = tl.where(on, tl.exp(Ga - tl.load(sg_ptr + r * sgr + hv)), 0.0)
            kr = tl.load(sk_ptr + r * skr + kh * K + ok)
            ur = tl.load(su_ptr + r * sur + hv * V + ov, mask=ovm, other=0.0)
            s += w * kr[:, None] * ur[None, :]
        tl.store(out_ptr + slot * sos + hv * soh + ok[:, None] * sok + ov[None, :] * sov,
                 s.to(out_ptr.dtype.element_ty), mask=ovm[None, :])

    @triton.jit
    def _conv_commit_kernel(h_ptr, slot_ptr, shs, shc, shw, xs_ptr, sxs, win_ptr, base_ptr,
                            rows_ptr, na_ptr, C, L1: tl.constexpr, W: tl.constexpr,
                            WP: tl.constexpr, BC: tl.constexpr):
        # the new history: the last accepted row's window without its oldest entry
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        ow = tl.arange(0, WP)
        wm = ow < W - 1
        slot = tl.load(slot_ptr + n)
        base = tl.load(base_ptr + n)
        last = base + tl.load(rows_ptr + n * L1 + tl.load(na_ptr + n))
        e = tl.load(win_ptr + last * W + 1 + ow, mask=wm, other=0)
        hist = e < W - 1
        hp = h_ptr + slot * shs + c[:, None] * shc
        old = tl.load(hp + e[None, :] * shw, mask=cm[:, None] & (wm & hist)[None, :],
                      other=0.0)
        xv = tl.load(xs_ptr + (base + e - (W - 1))[None, :] * sxs + c[:, None],
                     mask=cm[:, None] & (wm & ~hist)[None, :], other=0.0)
        new = tl.where(hist[None, :], old, xv.to(old.dtype))
        tl.store(hp + ow[None, :] * shw, new, mask=cm[:, None] & wm[None, :])


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def conv1d(x, tok, hist, slot, weight, bias, windows, silu, y, x_stash=None, srow=None):
    """y [N, T, C] = the tree conv of every verify row: x [rows, C] by tok [N, T];
    history hist[slot[n], c, 0 .. W-2] (any strides); weight [C, W]; windows [N, T, W].
    With x_stash, row (n, t)'s input also goes to x_stash[srow[n, t]]."""
    n, t, c = y.shape
    w = weight.shape[1]
    bc = min(256, next_pow2(c))
    copy = x_stash is not None
    _conv_kernel[(n, t, triton.cdiv(c, bc))](
        x, x.stride(0), _i64(tok), hist, _i64(slot), *hist.stride()[:3], weight,
        *weight.stride(), bias if bias is not None else weight, _i64(windows), y,
        y.stride(0), y.stride(1), x_stash if copy else y, x_stash.stride(0) if copy else 0,
        _i64(srow) if copy else tok, t, c, W=w, HAS_BIAS=bias is not None, SILU=silu,
        COPY_X=copy, BC=bc)
    return y


def verify(q, k, v, a, b, tok, mask, state, slot, out, orow, stash, srow, scale,
           A_log=None, dt_bias=None, l2=True, state_kv=True):
    """The tree-masked delta rule for every verify row.  q, k [N, T, H, K] and v
    [N, T, HV, V] (views with unit stride on the head dim); a, b [rows, HV] by tok
    [N, T]: the gate inputs (A_log and dt_bias given: vLLM's gating) or g and beta
    themselves; mask [N, T, T] int8; h0 = state[slot[n]], [HV, K, V] when state_kv else
    [HV, V, K] (vLLM's cache); o goes to out[orow[n, t]] ([rows, HV, V]); the stash
    (k [rows, H, K], u [rows, HV, V], G [rows, HV], float32) to its rows srow[n, t]."""
    n, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    if kd != next_pow2(kd) or kd < 16 or vd < 16:
        raise NotImplementedError(f"tree GDN kernel: head sizes K={kd}, V={vd} (K a "
                                  "power of 2, both >= 16)")
    if q.stride() != k.stride():
        raise ValueError("tree GDN kernel: q and k need the same strides")
    tp = max(16, next_pow2(t))
    bv = min(VERIFY_BLOCKS["bv"] or 32, next_pow2(vd))
    warps = VERIFY_BLOCKS["warps"] or (4 if tp <= 32 else 8)
    st = state.stride()
    shk, shv = (st[2], st[3]) if state_kv else (st[3], st[2])
    sk, su, sg = stash
    gates = A_log is not None
    _verify_kernel[(n, hv, triton.cdiv(vd, bv))](
        q, k, v, q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1),
        v.stride(2), a, b, a.stride(0), b.stride(0), _i64(tok),
        A_log if gates else a, dt_bias if gates else a, mask, state, _i64(slot), st[0],
        st[1], shk, shv, out, _i64(orow), out.stride(0), out.stride(1), sk, su, sg,
        _i64(srow), sk.stride(0), su.stride(0), sg.stride(0), float(scale), hv, h,
        T=t, TP=tp, K=kd, V=vd, BV=bv, NSQ=max(0, (t - 1).bit_length() - 1), GATES=gates,
        L2=l2, num_warps=warps)
    return out


def commit(state, slot, stash, base, rows, num, out=None, state_kv=True):
    """State at each request's last accepted row, from h0 = state[slot[n]] and the stash
    rows base[n] + rows[n, j] (j <= num[n]); written to out[slot[n]] (default: state,
    in place).  Layouts as in verify()."""
    out = state if out is None else out
    n, l1 = rows.shape
    hv = state.shape[1]
    sk, su, sg = stash
    kd = sk.shape[-1]
    vd = su.shape[-1]
    st, so = state.stride(), out.stride()
    hs = (st[0], st[1], st[2], st[3]) if state_kv else (st[0], st[1], st[3], st[2])
    os_ = (so[0], so[1], so[2], so[3]) if state_kv else (so[0], so[1], so[3], so[2])
    bv = min(64, next_pow2(vd))
    _commit_kernel[(n, hv, triton.cdiv(vd, bv))](
        state, out, _i64(slot), *hs, *os_, sk, su, sg, sk.stride(0), su.stride(0),
        sg.stride(0), _i64(base), _i64(rows), _i64(num), hv, sk.shape[-2], L1=l1, K=kd,
        V=vd, BV=bv)
    return out


def conv_commit(hist, slot, x_stash, windows, base, rows, num):
    """In place: hist[slot[n], :, 0 .. W-2] = the last W-1 inputs along request n's
    accepted path (windows [rows, W] by stash row, x_stash [rows, C])."""
    n, l1 = rows.shape
    c = x_stash.shape[1]
    w = windows.shape[1]
    bc = min(128, next_pow2(c))
    _conv_commit_kernel[(n, triton.cdiv(c, bc))](
        hist, _i64(slot), *hist.stride()[:3], x_stash, x_stash.stride(0), _i64(windows),
        _i64(base), _i64(rows), _i64(num), c, L1=l1, W=w, WP=max(2, next_pow2(w - 1)),
        BC=bc)
    return hist
