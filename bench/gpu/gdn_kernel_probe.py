#!/usr/bin/env python3
"""The tree GDN verify kernel alone (core/gdn_triton.py) per launch setting: rows
per chunk, V block, warps, dot precision; CUDA-graph replays at Qwen3.6-27B heads (16 key / 48 value
heads of 128), with its error against float64 (registers and spills of a launch:
bench/kernel_resources.py, no GPU needed).

    python bench/gpu/gdn_kernel_probe.py [--rows 17,33,65] [--batches 1,8]

Prints a table (microseconds, median of --reps).  No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdn_bench import H, HV, K, V, timed  # noqa: E402
from ddtree_patcher.patches.ddtree.payload.core import build_tree  # noqa: E402
from ddtree_patcher.patches.ddtree.payload.core import gdn_triton as gk  # noqa: E402
from ddtree_patcher.patches.ddtree.payload.core.gdn_tree import (  # noqa: E402
    gdn_gates, tree_gdn_verify, tree_mask)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="17,33,65")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--precs", default="ieee,tf32x3,tf32")
    ap.add_argument("--blocks", default="32x32x4,16x32x4,32x64x4,64x32x8,32x128x8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    dev = "cuda"
    rows = []
    for t, n in itertools.product(map(int, a.rows.split(",")), map(int, a.batches.split(","))):
        b = t - 1
        par = build_tree(torch.randn(n, 15, 256, generator=gen).to(dev) * 3, b, b).parents
        mask = tree_mask(par)
        q = torch.randn(n, t, H, K, generator=gen).to(dev, torch.bfloat16)
        k = torch.randn(n, t, H, K, generator=gen).to(dev, torch.bfloat16)
        v = torch.randn(n, t, HV, V, generator=gen).to(dev, torch.bfloat16)
        ga = torch.randn(n * t, HV, generator=gen).to(dev, torch.bfloat16)
        gb = torch.randn(n * t, HV, generator=gen).to(dev, torch.bfloat16)
        A_log = torch.randn(HV, generator=gen).to(dev) * 0.5
        dtb = torch.randn(HV, generator=gen).to(dev)
        state = (torch.randn(n, HV, V, K, generator=gen) * 0.1).to(dev, torch.bfloat16)
        g, beta = gdn_gates(ga, gb, A_log, dtb)
        want, _ = tree_gdn_verify(q.double(), k.double(), v.double(),
                                  g.view(n, t, HV).double(), beta.view(n, t, HV).double(),
                                  state.transpose(-1, -2).double(), mask, scale=K ** -0.5,
                                  backend="torch")
        idx = torch.arange(n * t, device=dev).view(n, t)
        slot = torch.arange(n, device=dev)
        m8 = mask.to(torch.int8).contiguous()
        out = torch.empty(n * t, HV, V, dtype=torch.bfloat16, device=dev)
        stash = (torch.empty(n * t, H, K, device=dev), torch.empty(n * t, HV, V, device=dev),
                 torch.empty(n * t, HV, device=dev))
        for prec, blk in itertools.product(a.precs.split(","), a.blocks.split(",")):
            bc, bv, warps = map(int, blk.split("x"))
            gk.VERIFY_BLOCKS.update(bc=bc, bv=bv, warps=warps, prec=prec)

            def run():
                gk.verify(q, k, v, ga, gb, idx, m8, state, slot, out, idx, stash, idx,
                          K ** -0.5, A_log=A_log, dt_bias=dtb, state_kv=False)
            try:
                run()
                torch.cuda.synchronize()
                err = (out.view(n, t, HV, V).double() - want).abs().max().item()
                us = timed(run, a.reps, True)
                r = dict(T=t, N=n, prec=prec, bc=bc, bv=bv, warps=warps, us=round(us, 1),
                         max_err=err)
            except Exception as e:  # a setting that does not compile: say so
                r = dict(T=t, N=n, prec=prec, bc=bc, bv=bv, warps=warps, error=repr(e)[:200])
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
