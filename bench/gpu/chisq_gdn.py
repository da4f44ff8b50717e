"""The sampled walk keeps the target distribution on the CUDA GDN path (issue #27).

    python3 bench/gpu/chisq_gdn.py OUTDIR [--rows v2,v1] [--samples 2000] [--eager]

A tiny dense Qwen3.5 hybrid with a 24-token vocabulary (verify/tiny_hybrid.py, the
CPU tier's sampled target), bf16, TRITON_ATTN, GDN prefill on Triton/FLA; T = 1, one
prompt, n = SAMPLES samples of 3 tokens.  no-spec and DDTree (B = 8, trees at every
step) each give a sample of the joint of the 3 tokens; a chi-square test of the pooled
contingency tables (outcomes seen >= 20 times in both, the rest pooled) must not reject
at p = 0.001: the joint of the 3 tokens (few well-filled cells at this vocabulary), each
token's marginal (24 cells: the power) and the pair of tokens 1-2 (cells seen >= 10
times); the walk must have accepted drafts, some through non-first children (paths
that commit a GDN state off the first child).  The p-value is torch's regularized
incomplete gamma (no scipy on the device).  Writes OUTDIR/chisq_gdn.json, prints a
table; exit 0 = every row passed.  --reanalyze: the tests again on a saved json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "verify"))
import common as C  # noqa: E402

SMALL = {"vocab_size": 24, "logit_scale": 8.0}  # as tests/engine/test_gdn_engine.py
PROMPT = [5, 9, 3, 7, 12]
BUDGET, DEPTH = 8, 4


def pooled(a: list, b: list, least: int = 20) -> list[list[int]]:
    """Contingency table: one row per outcome seen >= ``least`` times in both samples
    together, the rest pooled into a last row (tests/engine/request_jobs.py's)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.count(k) + b.count(k)))
    rows, other = [], [0, 0]
    for k in keys:
        x, y = a.count(k), b.count(k)
        if x + y >= least:
            rows.append([x, y])
        else:
            other[0] += x
            other[1] += y
    return rows + ([other] if sum(other) else [])


def chi2_p(table: list[list[int]]) -> tuple[float, float, int]:
    """(statistic, p, degrees of freedom) of the independence test of ``table``."""
    import torch

    t = torch.tensor(table, dtype=torch.float64)
    exp = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = float(((t - exp) ** 2 / exp).sum())
    dof = (t.shape[0] - 1) * (t.shape[1] - 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p, dof


def tests(ref: list, got: list) -> dict:
    """name -> (cells, statistic, dof, p) of the joint, the marginals and the pair."""
    ref, got = [tuple(x) for x in ref], [tuple(x) for x in got]
    tables = {"joint": pooled(ref, got), "pair12": pooled([x[:2] for x in ref],
                                                          [x[:2] for x in got], least=10)}
    for i in range(3):
        tables[f"token{i + 1}"] = pooled([x[i] for x in ref], [x[i] for x in got])
    out = {}
    for k, t in tables.items():
        stat, p, dof = chi2_p(t)
        out[k] = (len(t), stat, dof, p)
    return out


def models(base: Path) -> dict:
    import tiny_hybrid as TH

    t = TH.write_target(base / "target", arch="qwen3_5", **SMALL)
    d = TH.write_drafter(base / "drafter", t, kind="random", block_size=DEPTH + 1)
    return {"target": str(t), "drafter": str(d)}


def sample(m: dict, row: str, samples: int, eager: bool) -> dict:
    from vllm import LLM, SamplingParams

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0" if row == "v1" else "1"
    kw = dict(model=m["target"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=256, max_num_seqs=8, attention_backend="TRITON_ATTN",
              enforce_eager=eager, enable_prefix_caching=False,
              additional_config={"gdn_prefill_backend": "triton"},
              kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.5)
    if not eager:
        qs = (1 + BUDGET, 1) if row != "nospec" else (1,)
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": sorted(
                                        {k * q for q in qs for k in range(1, 9)})}
    if row != "nospec":
        kw["speculative_config"] = {"method": "ddtree", "model": m["drafter"],
                                    "num_speculative_tokens": BUDGET, "ddtree_depth": DEPTH,
                                    "ddtree_chain_budget": 0}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    sp = SamplingParams(temperature=1.0, max_tokens=3, n=samples, ignore_eos=True,
                        detokenize=False, seed=None)
    outs = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
    r = {"startup_s": round(time.perf_counter() - t0, 1),
         "joint": [tuple(o.token_ids) for o in outs[0].outputs]}
    C.teardown(llm)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--rows", default="v2,v1")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--reanalyze", action="store_true",
                    help="no engines: the tests on OUTDIR/chisq_gdn.json")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.reanalyze:
        res = json.loads((out / "chisq_gdn.json").read_text())
        return report(res, [r for r in a.rows.split(",") if r in res], out, a)
    m = models(Path("/tmp/chisq_gdn_models"))
    res: dict = {"config": {**vars(a), "small": SMALL, "prompt": PROMPT, "budget": BUDGET,
                            "depth": DEPTH}}
    for row in ["nospec"] + [r for r in a.rows.split(",") if r]:
        stats = out / f"stats_{row}.json"
        os.environ["VLLM_DDTREE_STATS_FILE"] = str(stats)
        try:
            res[row] = sample(m, row, a.samples, a.eager)
        except Exception:  # noqa: BLE001
            res[row] = {"error": traceback.format_exc()[-3000:]}
            C.log("FAILED", row, res[row]["error"][-1500:])
        if stats.is_file() and row != "nospec":
            res[row]["walk"] = json.loads(stats.read_text())
        C.dump(str(out / "chisq_gdn.json"), res)
    return report(res, [r for r in a.rows.split(",") if r], out, a)


def report(res: dict, names: list, out: Path, a) -> int:
    ref = res["nospec"].get("joint")
    rows, ok = [], True
    for row in names:
        r = res[row]
        if ref is None or "joint" not in r:
            rows.append((row, "-", "-", "-", "-", "-", "FAIL (error)"))
            ok = False
            continue
        got = tests(ref, r["joint"])
        w = r.get("walk") or {}
        good = (all(t[3] > 0.001 for t in got.values()) and got["joint"][0] >= 5
                and w.get("accepted", 0) > 0 and w.get("accepted_non_first_child", 0) > 0)
        ok &= good
        r["chi2"] = {k: dict(zip(("cells", "stat", "dof", "p"), t)) for k, t in got.items()}
        for k, (cells, stat, dof, p) in got.items():
            rows.append((f"{row} {k}", cells, f"{stat:.1f}", dof, f"{p:.3g}",
                         f"{w.get('accepted', '-')}/{w.get('accepted_non_first_child', '-')}",
                         "PASS" if good else "FAIL"))
    C.dump(str(out / "chisq_gdn.json"), res)
    head = ("row / test", "cells", "chi2", "dof", "p", "accepted/non-first", "verdict")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    print(f"\nRESULT chi-square GDN bf16 {'eager' if a.eager else 'graphs'} "
          f"{a.samples} samples: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
