#!/usr/bin/env python3
"""Compile the tree GDN Triton kernels (core/gdn_triton.py) for an NVIDIA target on any
machine, no GPU needed (Triton's bundled ptxas), and print each launch's registers and
spills: a compile error or a spill regression shows here before a device session.

    python bench/kernel_resources.py [--arch 90] [--json]

Rows: the verify at its default launch (bf16 inputs: 16-bit dots; fp32: tf32x3) for
17 / 65 / 257 rows, with a float32 state, with float32 inputs, and the conv, commit and
conv-commit kernels; the tree attention kernel at each bucket of its launch table, one
key loop and two; the drafter's top-K select (one program a row, and the split path's
three kernels) and the target argmax's two, at the 8B shape (V = 151,936, K = 64).  Exit 0 when every kernel compiled.  tests/core/test_gdn_kernels_compile.py
runs it for sm_80 and sm_90.  ``--attn-grid NxB``: the tree attention launch model instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, not interpret (set before triton loads)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ddtree_patcher.patches.ddtree.payload.core import gdn_triton as gk  # noqa: E402
from ddtree_patcher.patches.ddtree.payload.attention import triton_tree as ta  # noqa: E402
import importlib  # noqa: E402

# (the core package's names vocab_topk / row_argmax are its functions: the modules here)
_CORE = "ddtree_patcher.patches.ddtree.payload.core."
vt = importlib.import_module(_CORE + "vocab_topk")
vs = importlib.import_module(_CORE + "vocab_topk_split")
am = importlib.import_module(_CORE + "row_argmax")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
BF16 = ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "h_ptr", "o_ptr", "x_ptr", "y_ptr",
        "xs_ptr", "w_ptr", "out_ptr")
FP32 = ("alog_ptr", "dtb_ptr", "sk_ptr", "su_ptr", "sg_ptr")


def signature(fn, consts: dict, fp32_inputs: bool = False, fp32_state: bool = False) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name == "m_ptr":
                sig[name] = "*i8"
            elif name in FP32 or (fp32_inputs and name in BF16) or \
                    (fp32_state and name == "h_ptr"):
                sig[name] = "*fp32"
            elif name in BF16:
                sig[name] = "*bf16"
            else:
                sig[name] = "*i64"
        elif name == "scale":
            sig[name] = "fp32"
        elif name in ("HV", "H", "T", "C"):
            sig[name] = "i32"
        else:
            sig[name] = "i64"
    return sig


def resources(fn, consts: dict, arch: int, warps: int = 4, fp32_inputs: bool = False,
              fp32_state: bool = False, sig: dict | None = None, attrs: dict | None = None,
              options: dict | None = None):
    src = ASTSource(fn=fn, signature=sig or signature(fn, consts, fp32_inputs, fp32_state),
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, **(options or {})})
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d, "k.ptx")
        ptx.write_text(k.asm["ptx"])
        sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        out = subprocess.run([str(PTXAS), "-v", f"-arch={sm}", str(ptx), "-o",
                              str(Path(d, "k.cubin"))], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill.group(1)) if spill else None,
            "shared": k.metadata.shared}


# tree attention (attention/triton_tree.py) at Qwen3-8B's heads (G = 4, d = 128, bf16);
# the JIT marks 16-divisible pointers and strides, so these compile with those marks
ATTN_PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "BT": "*i32",
             "SEQ": "*i32", "QSL": "*i32", "HAS": "*i32", "MASK": "*i8", "PM": "*fp32",
             "PL": "*fp32", "PACC": "*fp32", "CNT": "*i32"}
ATTN_DIV16 = ("s_qt", "s_qh", "s_ot", "s_oh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh")


def attention_resources(arch: int, c: dict) -> dict:
    """Compile the tree attention kernel with launch config ``c`` (block_q, block_n,
    splits, two_loops, fused_combine, num_warps, num_stages, maxnreg) for Qwen3-8B's heads (G = 4,
    d = 128, bf16), with the JIT's 16-divisibility marks."""
    fn = ta._tree_attn_kernel
    bq, bn = c["block_q"], c["block_n"]
    consts = dict(G=4, BLOCK_Q=bq, M=max(16, triton.next_power_of_2(bq * 4)), BLOCK_N=bn,
                  D=128, DP=128, IEEE=False, USE_FOR=True, S=c["splits"], RP=256,
                  WINDOW=False, TWO_LOOPS=bool(c.get("two_loops")),
                  FUSED=bool(c.get("fused_combine")) and c["splits"] > 1)
    sig = {n: "constexpr" if n in consts else ATTN_PTRS.get(
        n, "fp32" if n == "scale" else "i32" if n in ("block_size", "NQB", "NKV", "window")
        else "i64") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in fn.arg_names if n in ATTN_PTRS or n in ATTN_DIV16}
    opts = {k: c[k] for k in ("num_stages", "maxnreg") if c.get(k)}
    return resources(fn, consts, arch, c.get("num_warps", 4), sig=sig, attrs=attrs,
                     options=opts)


def combine_resources(arch: int, block_q: int, splits: int, warps: int = 4,
                      rows: int | None = None) -> dict:
    """Compile the separate merge kernel (``_combine``) of a split launch: block_q query
    tokens x G = 4 heads a block, ``rows`` of them a program (default all), with the JIT's
    marks (without them ptxas spills where the engine's launch does not)."""
    fn = ta._combine
    m = max(16, triton.next_power_of_2(block_q * 4))
    consts = dict(G=4, BLOCK_Q=block_q, M=m, D=128, DP=128, S=splits, MC=min(m, rows or m))
    sig = {n: "constexpr" if n in consts else ATTN_PTRS.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in fn.arg_names if n in ATTN_PTRS or n in ATTN_DIV16}
    return resources(fn, consts, arch, warps, sig=sig, attrs=attrs)


def attention_rows(arch: int) -> list[dict]:
    """Each bucket of the built-in launch table, with one key loop and with two."""
    out = []
    for t in ta.TUNING:
        c = dict(block_q=t.get("block_q", 16), block_n=t.get("block_n", 64),
                 splits=t.get("splits", 1), **{k: t[k] for k in
                                               ("num_warps", "num_stages", "maxnreg") if k in t})
        for two in (False, True):
            r = attention_resources(arch, dict(c, two_loops=two))
            out.append({"kernel": "tree_attn", "rows": t["max_rows"],
                        "inputs": f"bq{c['block_q']} bn{c['block_n']} s{c['splits']}"
                                  f"{' 2loop' if two else ''}",
                        "chunk": c["block_n"], "warps": c.get("num_warps", 4), **r})
        if c["splits"] > 1:  # its merge launch, as in the table and one block in 4 pieces
            w = t.get("combine_warps", 4)
            for mr in (t.get("combine_rows"), 16):
                r = combine_resources(arch, c["block_q"], c["splits"], w, mr)
                out.append({"kernel": "combine", "rows": t["max_rows"],
                            "inputs": f"bq{c['block_q']} s{c['splits']} rows{mr or 'all'}",
                            "chunk": mr or c["block_q"] * 4, "warps": w, **r})
    return out


def attention_grid(arch: int, n: int = 1, b: int = 64, ctx: int = 512, sms: int = 132,
                   configs=None) -> list[dict]:
    """Tree attention launches at one verify shape (n requests of 1 + b rows, context
    ctx, 8 KV heads x G = 4, d = 128): per config its registers, spills, shared memory,
    programs per SM (registers, shared memory and 64 warps an SM), programs, waves on
    ``sms`` SMs and key tiles per program.  A model of the launch, not a timing."""
    import math

    out = []
    for c in configs or [dict(block_q=bq, block_n=bn, splits=sp, two_loops=two)
                         for bq in (4, 8, 16) for bn in (16, 32, 64) for sp in (1, 4, 8)
                         for two in (False, True)]:
        bq, bn, sp, warps = c["block_q"], c["block_n"], c["splits"], c.get("num_warps", 4)
        r = attention_resources(arch, c)
        per_sm = min(65536 // max(1, r["registers"] * 32 * warps),
                     (228 * 1024) // max(1, r["shared"]), 64 // warps)
        progs = n * math.ceil((b + 1) / bq) * 8 * sp
        tiles = math.ceil((ctx + b + 1) / (bn * sp))  # the last query block's keys
        out.append({**c, **r, "per_sm": per_sm, "programs": progs,
                    "waves": math.ceil(progs / max(1, per_sm * sms)), "tiles": tiles})
    return out


def rows(arch: int) -> list[dict]:
    out = []
    blocks = gk.VERIFY_BLOCKS
    # inputs: bf16 (and a bf16 state), bf16 with a float32 state (vLLM's
    # mamba_ssm_cache_dtype="float32"), all float32
    for t, inputs in ((17, "bf16"), (65, "bf16"), (257, "bf16"), (17, "bf16+fp32 state"),
                      (17, "fp32")):
        fp32, fp32_state = inputs == "fp32", inputs != "bf16"
        bc = min(blocks["bc"], max(16, 1 << (t - 1).bit_length()))
        warps = blocks["warps"] or (4 if bc <= 32 else 8)
        consts = dict(T=t, BC=bc, K=128, V=128, BV=blocks["bv"] or 32, NSQ=3, GATES=True,
                      L2=True, PREC=blocks["prec"], NATIVE_QK=not fp32,
                      NATIVE_H=not fp32_state)
        r = resources(gk._verify_kernel, consts, arch, warps, fp32, fp32_state)
        out.append({"kernel": "verify", "rows": t, "inputs": inputs,
                    "chunk": bc, "warps": warps, **r})
    for name, fn, consts in (
            ("conv", gk._conv_kernel, dict(W=4, HAS_BIAS=True, SILU=True, COPY_X=True,
                                           BC=256)),
            ("commit", gk._commit_kernel, dict(L1=16, LP=16, K=128, V=128, BV=32,
                                                 PREC="tf32x3")),
            ("conv_commit", gk._conv_commit_kernel, dict(L1=16, W=4, WP=4, BC=128))):
        out.append({"kernel": name, **resources(fn, consts, arch)})
    return out + attention_rows(arch) + select_rows(arch)


def select_rows(arch: int) -> list[dict]:
    """vocab_topk's select kernels and row_argmax's, as launched at V = 151,936, K = 64."""
    p = vs.plan(151936, 64)
    kp, nchp = p["kp"], 64
    ptrs = dict(x_ptr="*bf16", m_ptr="*fp32", s_ptr="*fp32", lse_ptr="*fp32",
                vals_ptr="*fp32")
    launches = (
        ("select", vt._select_kernel, dict(NCHP=nchp, NSUBP=4096, KP=kp, SUB=p["sub"],
                                           WITH_LSE=True), 8),
        ("topk_groups", vs._groups_kernel, dict(GS=p["gs"], KP=kp), 4),
        ("topk_gather", vs._gather_kernel, dict(AP=p["ap"], KP=kp, SUB=p["sub"],
                                                NG2=p["ng2"], BPG=p["bpg"]), 4),
        ("topk_final", vs._final_kernel, dict(NCHP=nchp, CP=p["ng2"] * kp, KP=kp,
                                              WITH_LSE=True), 4),
        ("argmax_part", am._part_kernel, dict(CH=am.CH), 4),
        ("argmax_final", am._final_kernel, dict(NCHP=nchp), 1))
    out = []
    for name, fn, consts, warps in launches:
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "*i64" if n.endswith("_ptr")
                                                             else "i64")
               for n in fn.arg_names}
        out.append({"kernel": name, "warps": warps,
                    **resources(fn, consts, arch, warps, sig=sig)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--attn-grid", metavar="NxB", help="instead: the tree attention launch "
                    "model over a grid of configs at N requests of 1 + B rows (e.g. 1x64)")
    a = ap.parse_args(argv)
    if a.attn_grid:
        n, b = (int(v) for v in a.attn_grid.split("x"))
        grid = attention_grid(a.arch, n, b)
        if a.json:
            print(json.dumps(grid))
            return 0
        print(f"sm_{a.arch}, {n} x (1 + {b}) rows, context 512: block_q block_n splits "
              "two_loops | registers spill shared | per SM, programs, waves, tiles a program")
        for r in grid:
            print(f"  {r['block_q']:>3} {r['block_n']:>3} {r['splits']:>2} "
                  f"{'2' if r['two_loops'] else '1':>2} | {r['registers']:>4} "
                  f"{r['spill_stores']:>5} {r['shared']:>6} | {r['per_sm']:>2} "
                  f"{r['programs']:>5} {r['waves']:>2} {r['tiles']:>3}")
        return 0
    table = rows(a.arch)
    if a.json:
        print(json.dumps(table))
        return 0
    print(f"sm_{a.arch}: kernel, rows, inputs, chunk, warps, registers, spill stores, shared")
    for r in table:
        print(f"  {r['kernel']:<12} {r.get('rows', '-'):>4} {r.get('inputs', '-'):>16} "
              f"{r.get('chunk', '-'):>4} {r.get('warps', 4):>3} {r['registers']:>5} "
              f"{r['spill_stores']:>6} {r['shared']:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
