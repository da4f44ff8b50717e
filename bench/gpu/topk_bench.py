"""Two of the tree step's own kernels on the GPU against what the engine runs now,
CUDA-graph replays of bf16 logits [rows, V], every impl checked against torch first:

- the drafter's top-K + lse: vocab_topk's one-program select ('fused', the engine's
  path under 'auto'), the select spread over programs ('split',
  core/vocab_topk_split.py), torch.topk on order keys ('torch');
- the greedy walk's target argmax: torch.argmax ('torch', the engine's) against
  core/row_argmax.py ('triton').

    [TOPK_FROM_CHECKOUT=1] python bench/gpu/topk_bench.py OUT_DIR [--rows 15,30,60]
        [--argmax-rows 64,128] [--vocab 151936] [--k 64] [--rounds 3] [--reps 50]

Rows: the drafter's L = 15 positions per request, the verify's 1 + 63 rows per request
(1, 2, 4, 16, 64 requests).  Prints a table each (us per call, median over rounds
(min-max), new / engine) and writes topk_bench.json.  TOPK_FROM_CHECKOUT=1: this
checkout's payload (torch + Triton only); else the payload `ddtree-patch apply` put
into vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

IMPLS = ("fused", "split", "torch")
ARGMAX_IMPLS = ("torch", "triton")


def payload(name: str):
    """core/<name>.py: from this checkout (TOPK_FROM_CHECKOUT=1) or as applied to vLLM."""
    if os.environ.get("TOPK_FROM_CHECKOUT"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        return importlib.import_module(f"ddtree_patcher.patches.ddtree.payload.core.{name}")
    return importlib.import_module(f"vllm.v1.spec_decode.ddtree.core.{name}")


def wall_us(fn, reps: int) -> float:
    """Median us of fn by the wall clock (--device cpu: the script's own check)."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


def table(results: list[dict], impls=IMPLS, new="split", old="fused") -> str:
    """Markdown: one line per row count, us per impl as median (min-max), new / old."""
    out = ["| rows | " + " | ".join(f"{i} us" for i in impls) + f" | {new} / {old} |",
           "| ---: | " + " | ".join("---" for _ in impls) + " | ---: |"]
    for r in results:
        cells = []
        for i in impls:
            ts = r["us"].get(i)
            cells.append("-" if not ts else
                         f"{statistics.median(ts):.1f} ({min(ts):.1f}-{max(ts):.1f})")
        f, s = r["us"].get(old), r["us"].get(new)
        ratio = f"{statistics.median(s) / statistics.median(f):.3f}" if f and s else "-"
        out.append(f"| {r['rows']} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(out)


def timed(impls, call, check, rounds: int, reps: int, cuda: bool = True) -> dict | None:
    """{impl: [us per round]} after check(impl) passed for every impl (else None)."""
    for impl in impls:
        if not check(impl):
            return None
    us = {i: [] for i in impls}
    for _ in range(rounds):  # the impls interleaved round by round
        for impl in impls:
            us[impl].append(C.graph_us(lambda: call(impl), reps) if cuda else
                            wall_us(lambda: call(impl), reps))
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rows", default="15,30,60,240,960")
    ap.add_argument("--argmax-rows", default="64,128,256,1024")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda",
                    help="cpu: a check of this script under TRITON_INTERPRET=1 (no timing)")
    a = ap.parse_args(argv)
    import torch

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("topk_bench: needs a CUDA device", file=sys.stderr)
        return 2
    vt, am = payload("vocab_topk"), payload("row_argmax")
    gen = torch.Generator(device=a.device).manual_seed(0)

    def logits(n):
        x = torch.randn(n, a.vocab, device=a.device, generator=gen) * 3
        return x.to(torch.bfloat16 if cuda else torch.float16)  # the interpreter: no bf16

    def topk_same(x, ref):
        def same(impl):
            got = vt.vocab_topk(x, a.k, impl=impl)
            return torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and \
                torch.allclose(got[2], ref[2], rtol=2e-6, atol=1e-5)
        return same

    sections = {  # name: (row counts, impls, call(x, impl), reference(x), check(x, ref))
        "top-K": (a.rows, IMPLS, lambda x, i: vt.vocab_topk(x, a.k, impl=i),
                  lambda x: vt.vocab_topk(x, a.k, impl="torch"), topk_same),
        "argmax": (a.argmax_rows, ARGMAX_IMPLS, lambda x, i: am.row_argmax(x, impl=i),
                   lambda x: x.argmax(-1),
                   lambda x, ref: lambda i: torch.equal(am.row_argmax(x, impl=i), ref))}
    out = {}
    for name, (counts, impls, call, reference, check) in sections.items():
        out[name] = []
        for n in [int(r) for r in counts.split(",") if r]:
            x = logits(n)
            us = timed(impls, lambda i: call(x, i), check(x, reference(x)), a.rounds,
                       a.reps, cuda)
            if us is None:
                print(f"MISMATCH {name} rows {n}", flush=True)
                return 1
            out[name].append(dict(rows=n, us=us))
            print(f"{name} rows {n}: " + ", ".join(f"{i} {statistics.median(t):.1f} us"
                                                   for i, t in us.items()), flush=True)
    results, argmax = out["top-K"], out["argmax"]
    os.makedirs(a.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if cuda else a.device, vocab=a.vocab, k=a.k,
                rounds=a.rounds, reps=a.reps, results=results, argmax=argmax)
    with open(os.path.join(a.out, "topk_bench.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(table(results))
    print()
    print(table(argmax, ARGMAX_IMPLS, new="triton", old="torch"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
