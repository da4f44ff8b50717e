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

from ._triton import HAS_TRITON, interpreting, next_pow2, tl, triton

L2_EPS = 1e-6

# launch knobs of the verify: rows per chunk (bc), the V block of a program (None: 32),
# its warps (None: 4 up to 32 rows a chunk, else 8) and the precision of its float32 dots (tf32x3: tensor cores,
# about float32's error; ieee: CUDA cores).  bench/gpu/gdn_kernel_probe.py sweeps them.
VERIFY_BLOCKS = {"bc": 16, "bv": None, "warps": None, "prec": "tf32x3"}

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
    def _rows(q_ptr, k_ptr, a_ptr, b_ptr, sa, sb, tok_ptr, alog_ptr, dtb_ptr, n, hv, kh,
              sqn, sqt, sqh, scale, rc, rm, ok, T: tl.constexpr, GATES: tl.constexpr,
              L2: tl.constexpr):
        # one chunk of rows: raw q, k, their l2 scales (q's times scale), g, beta
        qr = tl.load(q_ptr + n * sqn + rc[:, None] * sqt + kh * sqh + ok[None, :],
                     mask=rm[:, None], other=0.0)
        kr = tl.load(k_ptr + n * sqn + rc[:, None] * sqt + kh * sqh + ok[None, :],
                     mask=rm[:, None], other=0.0)
        if L2:
            qf = qr.to(tl.float32)
            kf = kr.to(tl.float32)
            rq = tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6) * scale
            rk = tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)
        else:
            rq = tl.where(rm, 1.0, 1.0) * scale
            rk = tl.where(rm, 1.0, 1.0)
        tok = tl.load(tok_ptr + n * T + rc, mask=rm, other=0)
        g = tl.load(a_ptr + tok * sa + hv, mask=rm, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + tok * sb + hv, mask=rm, other=0.0).to(tl.float32)
        if GATES:  # vLLM's fused_gdn_gating
            x = g + tl.load(dtb_ptr + hv).to(tl.float32)
            sp = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
            g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * sp
            beta = tl.sigmoid(beta)
        return qr, kr, rq, rk, tl.where(rm, g, 0.0), tl.where(rm, beta, 0.0)

    @triton.jit
    def _dot(a, b, NATIVE: tl.constexpr, PREC: tl.constexpr):
        # 16-bit operands: their own dot (exact products, float32 sums); else PREC
        if NATIVE:
            return tl.dot(a, b)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)

    @triton.jit
    def _verify_kernel(q_ptr, k_ptr, v_ptr, sqn, sqt, sqh, svn, svt, svh,
                       a_ptr, b_ptr, sa, sb, tok_ptr, alog_ptr, dtb_ptr, m_ptr,
                       h_ptr, slot_ptr, shs, shh, shk, shv, o_ptr, orow_ptr, sor, soh,
                       sk_ptr, su_ptr, sg_ptr, srow_ptr, skr, sur, sgr, scale, HV, H,
                       T: tl.constexpr, BC: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BV: tl.constexpr, NSQ: tl.constexpr,
                       GATES: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
                       NATIVE_QK: tl.constexpr, NATIVE_H: tl.constexpr):
        # One program per (request, value head, V block).  Rows go in chunks of BC,
        # parents first: a chunk's u needs the u of earlier chunks (read back from the
        # stash: this program wrote them) and its own block's inverse, by doubling.
        # G and u of earlier chunks are written by every V block's program alike (the
        # same G, each its own u columns), so reading them back races with nobody.
        n = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        kh = hv // (HV // H)
        oc = tl.arange(0, BC)
        ok = tl.arange(0, K)
        slot = tl.load(slot_ptr + n)
        ov = vb * BV + tl.arange(0, BV)
        ovm = ov < V
        h0 = tl.load(h_ptr + slot * shs + hv * shh + ok[:, None] * shk + ov[None, :] * shv,
                     mask=ovm[None, :], other=0.0)  # [K, BV]
        if not NATIVE_H:
            h0 = h0.to(tl.float32)
        first = vb == 0
        for c0 in range(0, T, BC):  # a loop, not unrolled: large budgets compile fast
            rc = c0 + oc
            rm = rc < T
            qr, kr, rq, rk, g, beta = _rows(q_ptr, k_ptr, a_ptr, b_ptr, sa, sb, tok_ptr,
                                            alog_ptr, dtb_ptr, n, hv, kh, sqn, sqt, sqh,
                                            scale, rc, rm, ok, T, GATES, L2)
            mrow = m_ptr + (n * T + rc[:, None]) * T
            md = tl.load(mrow + rc[None, :], mask=rm[:, None] & rm[None, :], other=0) != 0
            G = tl.sum(tl.where(md, g[None, :], 0.0), 1)  # along the path: this chunk
            for p0 in range(0, c0, BC):  # ... and the earlier ones
                rp = p0 + oc
                _, _, _, _, gp, _ = _rows(q_ptr, k_ptr, a_ptr, b_ptr, sa, sb, tok_ptr,
                                          alog_ptr, dtb_ptr, n, hv, kh, sqn, sqt, sqh,
                                          scale, rp, rp < T, ok, T, GATES, L2)
                mp = tl.load(mrow + rp[None, :], mask=rm[:, None], other=0) != 0
                G += tl.sum(tl.where(mp, gp[None, :], 0.0), 1)
            eg = tl.exp(G)
            vm = rm[:, None] & ovm[None, :]
            v = tl.load(v_ptr + n * svn + rc[:, None] * svt + hv * svh + ov[None, :],
                        mask=vm, other=0.0).to(tl.float32)
            r = beta[:, None] * (v - (eg * rk)[:, None] * _dot(kr, h0, NATIVE_H, PREC))
            o = (eg * rq)[:, None] * _dot(qr, h0, NATIVE_H, PREC)
            srow = tl.load(srow_ptr + n * T + rc, mask=rm, other=0)
            for p0 in range(0, c0, BC):  # earlier chunks (all rows real)
                rp = p0 + oc
                _, kp, _, rkp, _, _ = _rows(q_ptr, k_ptr, a_ptr, b_ptr, sa, sb, tok_ptr,
                                            alog_ptr, dtb_ptr, n, hv, kh, sqn, sqt, sqh,
                                            scale, rp, rp < T, ok, T, GATES, L2)
                sp = tl.load(srow_ptr + n * T + rp)
                Gp = tl.load(sg_ptr + sp * sgr + hv)
                mp = tl.load(mrow + rp[None, :], mask=rm[:, None], other=0) != 0
                used = tl.max(mp.to(tl.int32), 0) > 0  # pads' u (a dump row): never read
                up = tl.load(su_ptr + sp[:, None] * sur + hv * V + ov[None, :],
                             mask=used[:, None] & ovm[None, :], other=0.0)
                dec = tl.where(mp, tl.exp(G[:, None] - Gp[None, :]), 0.0)
                kk = _dot(kr, tl.trans(kp), NATIVE_QK, PREC) * rk[:, None] * rkp[None, :]
                qk = _dot(qr, tl.trans(kp), NATIVE_QK, PREC) * rq[:, None] * rkp[None, :]
                r -= beta[:, None] * tl.dot(dec * kk, up, input_precision=PREC)
                o += tl.dot(dec * qk, up, input_precision=PREC)
            dec = tl.where(md, tl.exp(G[:, None] - G[None, :]), 0.0)
            kk = _dot(kr, tl.trans(kr), NATIVE_QK, PREC) * rk[:, None] * rk[None, :]
            P = -tl.where(oc[:, None] > oc[None, :], dec * kk, 0.0) * beta[:, None]
            Mi = tl.where(oc[:, None] == oc[None, :], 1.0, 0.0) + P
            for _ in tl.static_range(NSQ):  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...
                P = tl.dot(P, P, input_precision=PREC)
                Mi = Mi + tl.dot(Mi, P, input_precision=PREC)
            u = tl.dot(Mi, r, input_precision=PREC)
            qk = _dot(qr, tl.trans(kr), NATIVE_QK, PREC) * rq[:, None] * rk[None, :] * dec
            o += tl.dot(qk, u, input_precision=PREC)
            orow = tl.load(orow_ptr + n * T + rc, mask=rm, other=0)
            tl.store(o_ptr + orow[:, None] * sor + hv * soh + ov[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=vm)
            tl.store(su_ptr + srow[:, None] * sur + hv * V + ov[None, :], u, mask=vm)
            tl.store(sg_ptr + srow * sgr + hv, G, mask=rm)
            tl.store(sk_ptr + srow[:, None] * skr + kh * K + ok[None, :],
                     kr.to(tl.float32) * rk[:, None],
                     mask=rm[:, None] & (first & (hv % (HV // H) == 0)))
            tl.debug_barrier()  # this chunk's G and u are read by the next ones

    @triton.jit
    def _commit_kernel(h_ptr, out_ptr, slot_ptr, shs, shh, shk, shv, sos, soh, sok, sov,
                       sk_ptr, su_ptr, sg_ptr, skr, sur, sgr, base_ptr, rows_ptr, na_ptr,
                       HV, H, L1: tl.constexpr, LP: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        # S_a = e^{G_a} h0 + sum_path e^{G_a - G_s} k_s u_s^T; in place when out = h.
        # The path's rows are loaded at once and summed by one dot (K x LP x BV), not a
        # loop of dependent loads.
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
        h = tl.load(h_ptr + slot * shs + hv * shh + ok[:, None] * shk + ov[None, :] * shv,
                    mask=ovm[None, :], other=0.0).to(tl.float32)
        j = tl.arange(0, LP)
        on = j <= a
        r = base + tl.load(rows_ptr + n * L1 + j, mask=on, other=0)
        w = tl.where(on, tl.exp(Ga - tl.load(sg_ptr + r * sgr + hv, mask=on, other=0.0)),
                     0.0)
        kr = tl.load(sk_ptr + r[:, None] * skr + kh * K + ok[None, :], mask=on[:, None],
                     other=0.0)  # [LP, K]
        ur = tl.load(su_ptr + r[:, None] * sur + hv * V + ov[None, :],
                     mask=on[:, None] & ovm[None, :], other=0.0)  # [LP, BV]
        s = tl.exp(Ga) * h + tl.dot(tl.trans(kr * w[:, None]), ur, input_precision=PREC)
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
           A_log=None, dt_bias=None, l2=True, state_kv=True, depth=None):
    """The tree-masked delta rule for every verify row.  q, k [N, T, H, K] and v
    [N, T, HV, V] (views with unit stride on the head dim); a, b [rows, HV] by tok
    [N, T]: the gate inputs (A_log and dt_bias given: vLLM's gating) or g and beta
    themselves; mask [N, T, T] int8; h0 = state[slot[n]], [HV, K, V] when state_kv else
    [HV, V, K] (vLLM's cache); o goes to out[orow[n, t]] ([rows, HV, V]); the stash
    (k [rows, H, K], u [rows, HV, V], G [rows, HV], float32) to its rows srow[n, t].
    depth: the most edges on any root-to-row path (default T - 1; the inverse takes
    ceil(log2(depth + 1)) doubling steps, so a wrong bound gives wrong rows)."""
    n, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    if kd != next_pow2(kd) or kd < 16 or vd < 16:
        raise NotImplementedError(f"tree GDN kernel: head sizes K={kd}, V={vd} (K a "
                                  "power of 2, both >= 16)")
    if q.stride() != k.stride():
        raise ValueError("tree GDN kernel: q and k need the same strides")
    bc = min(VERIFY_BLOCKS["bc"], max(16, next_pow2(t)))
    bv = min(VERIFY_BLOCKS["bv"] or 32, next_pow2(vd))
    warps = VERIFY_BLOCKS["warps"] or (4 if bc <= 32 else 8)
    st = state.stride()
    shk, shv = (st[2], st[3]) if state_kv else (st[3], st[2])
    sk, su, sg = stash
    gates = A_log is not None
    d = t - 1 if depth is None else min(t - 1, depth)
    # 16-bit dots on the GPU (the interpreter multiplies bf16 wrongly: it upcasts)
    native = q.dtype in (torch.bfloat16, torch.float16) and not interpreting()
    _verify_kernel[(n, hv, triton.cdiv(vd, bv))](
        q, k, v, q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1),
        v.stride(2), a, b, a.stride(0), b.stride(0), _i64(tok),
        A_log if gates else a, dt_bias if gates else a, mask, state, _i64(slot), st[0],
        st[1], shk, shv, out, _i64(orow), out.stride(0), out.stride(1), sk, su, sg,
        _i64(srow), sk.stride(0), su.stride(0), sg.stride(0), float(scale), hv, h,
        T=t, BC=bc, K=kd, V=vd, BV=bv, NSQ=max(0, min(d, bc - 1).bit_length() - 1),
        GATES=gates,
        L2=l2, PREC=VERIFY_BLOCKS["prec"], NATIVE_QK=native, NATIVE_H=native and
        state.dtype == q.dtype, num_warps=warps)
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
    bv = min(32, next_pow2(vd))
    _commit_kernel[(n, hv, triton.cdiv(vd, bv))](
        state, out, _i64(slot), *hs, *os_, sk, su, sg, sk.stride(0), su.stride(0),
        sg.stride(0), _i64(base), _i64(rows), _i64(num), hv, sk.shape[-2], L1=l1,
        LP=max(16, next_pow2(l1)), K=kd, V=vd, BV=bv, PREC=VERIFY_BLOCKS["prec"])
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
