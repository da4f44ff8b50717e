"""DDTree under tensor parallelism: two GPUs, real (patched) vLLM 0.32.0.

    python bench/gpu/tp_equality.py OUT_DIR          (2 GPUs; prints a table + JSON)

The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with vLLM's
multiprocessing executor (distributed_executor_backend="mp": the executor for TP > 1
in-process; "uni" serves one GPU only), so each TP = 2 engine spawns one worker per GPU
(NCCL).  In-process hooks can't reach the workers: what runs there goes through
llm.collective_rpc (its callables are pickled by value), and each rank writes its own
walk statistics ($VLLM_DDTREE_STATS_FILE, rank r > 0: <stem>.rank<r>.json).

Stages ($TP_STAGES, default "eq bench control"; in this order):
  eq       tiny models of equality.py, TP = 2, FULL CUDA graphs (FULL_DECODE_ONLY,
           mode 0), B = 32, L = 7, 8 prompts (0-3 synthetic drafter, 4-7 random):
           fp32 TRITON_ATTN: no-spec (eager) vs DDTree twice (two engines, same seed):
           greedy 8 prompts, then a sampled batch (T = 0.8, top-p 0.95; even prompts
           seeded, odd ones not) that must repeat exactly across the two engines;
           bf16 FLASH_ATTN: no-spec vs DDTree (graphs).  Per DDTree engine: the
           ranks' walk statistics must be identical, and the eager tree-attention
           calls per rank are counted (0 = every verify replayed a FULL graph).
  bench    step table: Qwen3-8B shape (dummy weights), bf16 FLASH_ATTN, FULL graphs,
           random DFlash-b16 drafter (acceptance ~0), prompt 512: chain15 vs ddtree64 at
           TP = 1 (uni executor) and TP = 2 (mp), batch 1 and 16; step = wall time
           between consecutive executor.execute_model calls (median over uniform
           verify steps), measured in the engine process.
  control  bf16 FLASH_ATTN DFlash chain at TP = 2: do bf16 differences come from
           rounding (the chain differs too) or from DDTree?
Runs stop starting engines when $TP_DEADLINE_S (default 450) would be passed; what
ran is in OUT_DIR/tp_equality.json.  $VLLM_USE_V2_MODEL_RUNNER picks the runner (=1:
V2).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1: set here if unset; the script refuses other values).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in MULTICAST_OFF.items():
    if os.environ.setdefault(_k, _v) != _v:
        sys.exit(f"refusing to run: {_k}={os.environ[_k]} (NVLink multicast must stay off)")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # 0.32 bundles: no flashinfer
os.environ.setdefault("BENCH_BATCHES", "1,16")  # step_bench.engine's capture sizes
os.environ.setdefault("BENCH_E2E_BATCHES", "")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import equality as EQ  # noqa: E402
import step_bench as SB  # noqa: E402

TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
BENCH_CONFIGS = ("chain15", "ddtree64")
START = time.time()
DEADLINE = float(os.environ.get("TP_DEADLINE_S", "450"))
_ENGINE_S: list[float] = []  # wall time of each finished engine (deadline estimate)


# ------------------------------------------------------------- on the workers (rpc)

def _w_info(worker):
    import torch.distributed as dist

    mr = worker.model_runner
    d = getattr(mr, "drafter", None)
    return {"rank": dist.get_rank() if dist.is_initialized() else 0,
            "runner": type(mr).__name__, "drafter": type(d).__name__ if d else None}


def _w_tree_calls(worker, reset):
    """Eager calls of the CUDA tree attention on this rank (installs a counter)."""
    import vllm.v1.spec_decode.ddtree.attention.triton_tree as ca

    box = getattr(ca, "_tp_eq_calls", None)
    if box is None:
        orig, box = ca.tree_attention, [0]

        def counted(*a, **k):
            box[0] += 1
            return orig(*a, **k)

        ca.tree_attention, ca._tp_eq_calls = counted, box
    n = box[0]
    if reset:
        box[0] = 0
    return n


# ------------------------------------------------------------- engine process side

def time_left(name: str) -> bool:
    est = statistics.fmean(_ENGINE_S) if _ENGINE_S else 60.0
    if time.time() - START + est > DEADLINE:
        C.log("SKIPPED (deadline)", name)
        return False
    return True


def rank_paths(path: str) -> tuple[str, str]:
    """Where rank 0 and rank 1 write their walk statistics (runtime.rank_path)."""
    stem, ext = os.path.splitext(path)
    return path, f"{stem}.rank1{ext}"


def rank_stats(path: str) -> list:
    """The walk statistics of rank 0 and rank 1 (None where a rank wrote none)."""
    out = []
    for p in rank_paths(path):
        try:
            with open(p) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append(None)
    return out


def sampled_params(n: int, max_tokens: int):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                           ignore_eos=True, detokenize=False,
                           seed=100 + i if i % 2 == 0 else None) for i in range(n)]


def eq_run(name, res, out_dir, base, toks, dtype, backend, mode, sampled=False, **kw):
    """One TP = 2 engine of the tiny models: greedy outputs (+ a sampled batch), the
    ranks' walk statistics and eager tree-attention calls."""
    if not time_left(name):
        res[name] = {"skipped": "deadline"}
        return
    C.log("run", name)
    t0 = time.time()
    stats = os.path.join(out_dir, f"stats_{name}.json") if mode == "ddtree" else None
    for p in rank_paths(stats) if stats else ():
        if os.path.exists(p):  # an earlier run's
            os.remove(p)
    llm = None
    try:
        llm = EQ.engine(base, dtype, backend, mode, stats=stats, **TP2, **kw)
        r = res[name] = {"workers": llm.collective_rpc(_w_info)}
        if mode == "ddtree":
            llm.collective_rpc(_w_tree_calls, args=(True,))
        got = C.generate(llm, toks, EQ.MAX_TOKENS, margins=mode == "nospec")
        r.update(tokens=got[0], seconds=got[1])
        if mode == "nospec":
            r["top2_gaps"] = got[2]
        else:
            r["eager_tree_attention_calls"] = llm.collective_rpc(_w_tree_calls,
                                                                 args=(False,))
        if sampled:
            outs = llm.generate([{"prompt_token_ids": p} for p in toks],
                                sampled_params(len(toks), EQ.MAX_TOKENS), use_tqdm=False)
            r["sampled"] = [list(o.outputs[0].token_ids) for o in outs]
        if stats:  # each rank rewrites its file after every step: complete by now
            r["walk_per_rank"] = rank_stats(stats)
            w0, w1 = r["walk_per_rank"]
            r["ranks_identical"] = w0 == w1 if w0 is not None else None
    except Exception:
        res[name] = {"error": traceback.format_exc()[-3000:]}
        C.log("FAILED", name, res[name]["error"][-800:])
    finally:
        if llm is not None:
            C.teardown(llm)
    _ENGINE_S.append(time.time() - t0)
    C.dump(os.path.join(out_dir, "tp_equality.json"), res)


class StepClock:
    """Start time and scheduled tokens of every executor.execute_model call (one per
    engine step) in the engine process; works for the uni and the mp executor."""

    def __init__(self, llm):
        ex = llm.llm_engine.model_executor
        orig = ex.execute_model
        self.steps: list[tuple[float, int]] = []

        def timed(scheduler_output, *a, **k):
            self.steps.append((time.perf_counter(),
                               scheduler_output.total_num_scheduled_tokens))
            return orig(scheduler_output, *a, **k)

        ex.execute_model = timed

    def step_ms(self, verify_tokens: int):
        st = self.steps
        walls = [(st[i + 1][0] - st[i][0]) * 1e3 for i in range(len(st) - 1)
                 if st[i][1] == verify_tokens]
        return (statistics.median(walls) if walls else None), len(walls)


def bench_run(name, tp, res, out_dir):
    key = f"{name}_tp{tp}"
    if not time_left(key):
        res["bench"][key] = {"skipped": "deadline"}
        return
    C.log("engine", key)
    t0 = time.time()
    spec = SB.parse(name)
    llm = None
    try:
        llm = SB.engine(spec, **(TP2 if tp == 2 else {}))
        clock = StepClock(llm)
        r = res["bench"][key] = {"init_s": time.time() - t0, "steps": {}}
        for i, n in enumerate((1, 16)):
            toks = C.prompts(n, SB.PROMPT, 1000, 100000, seed=n)
            if i == 0:
                C.generate(llm, toks, 8)  # warm-up (Triton compiles, allocator)
            clock.steps = []
            outs, dt = C.generate(llm, toks, SB.NEW)
            ms, count = clock.step_ms(n * (1 + spec["k"]))
            r["steps"][str(n)] = {"step_ms": ms, "verify_steps": count, "generate_s": dt,
                                  "tokens": sum(len(o) for o in outs)}
            C.log(key, "N", n, "step ms", ms, "steps", count)
    except Exception:
        res["bench"][key] = {"error": traceback.format_exc()[-3000:]}
        C.log("FAILED", key, res["bench"][key]["error"][-800:])
    finally:
        if llm is not None:
            C.teardown(llm)
    _ENGINE_S.append(time.time() - t0)
    C.dump(os.path.join(out_dir, "tp_equality.json"), res)


def same(a, b) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def summarize(res) -> dict:
    s = {}
    ref = res.get("fp32_nospec_eager", {}).get("tokens")
    gaps = res.get("fp32_nospec_eager", {}).get("top2_gaps")
    for name in ("fp32_ddtree_graphs", "fp32_ddtree_graphs_again"):
        r = res.get(name, {})
        s[f"{name}_equal_nospec"] = same(ref, r.get("tokens"))
        if ref and r.get("tokens"):
            s[f"{name}_first_diffs"] = EQ.first_diffs(ref, r["tokens"], gaps)
    a, b = (res.get(n, {}).get("sampled") for n in ("fp32_ddtree_graphs",
                                                    "fp32_ddtree_graphs_again"))
    if a and b:
        s["sampled_repeat_seeded"] = same(a[0::2], b[0::2])
        s["sampled_repeat_unseeded"] = same(a[1::2], b[1::2])
    ref16 = res.get("bf16_fa_nospec_graphs", {}).get("tokens")
    gaps16 = res.get("bf16_fa_nospec_graphs", {}).get("top2_gaps")
    for name in ("bf16_fa_ddtree_graphs", "bf16_fa_dflash_graphs"):
        got = res.get(name, {}).get("tokens")
        s[f"{name}_equal_nospec"] = same(ref16, got)
        if ref16 and got:
            s[f"{name}_first_diffs"] = EQ.first_diffs(ref16, got, gaps16)
    for name, r in res.items():
        if isinstance(r, dict) and "ranks_identical" in r:
            s[f"{name}_ranks_identical"] = r["ranks_identical"]
            s[f"{name}_eager_tree_calls"] = r.get("eager_tree_attention_calls")
            w = r["walk_per_rank"][0] or {}
            s[f"{name}_walk"] = {k: w.get(k) for k in ("trees", "accepted",
                                                       "accepted_non_first_child",
                                                       "max_accepted")}
    return s


def step_table(bench: dict) -> list[str]:
    cols = [(tp, n) for tp in (1, 2) for n in (1, 16)]
    lines = ["| config | " + " | ".join(f"TP={tp} N={n}" for tp, n in cols) +
             " | TP2/TP1 N=1 | TP2/TP1 N=16 |",
             "| --- |" + " ---: |" * (len(cols) + 2)]

    def ms(cfg, tp, n):
        return bench.get(f"{cfg}_tp{tp}", {}).get("steps", {}).get(str(n), {}).get("step_ms")

    for cfg in BENCH_CONFIGS:
        vals = [ms(cfg, tp, n) for tp, n in cols]
        ratios = [(ms(cfg, 2, n) / ms(cfg, 1, n)) if ms(cfg, 2, n) and ms(cfg, 1, n)
                  else None for n in (1, 16)]
        cells = [f"{v:.2f}" if v else "-" for v in vals] + \
                [f"{x:.2f}" if x else "-" for x in ratios]
        lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
    chain, tree = BENCH_CONFIGS
    ratios = [(ms(tree, tp, n) / ms(chain, tp, n)) if ms(tree, tp, n) and ms(chain, tp, n)
              else None for tp, n in cols]
    lines.append(f"| {tree} / {chain} | " + " | ".join(f"{x:.2f}" if x else "-"
                                                       for x in ratios) + " | | |")
    return lines


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    import torch
    import vllm

    if torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    stages = os.environ.get("TP_STAGES", "eq bench control").split()
    res = {"config": {"B": EQ.B, "L": EQ.L, "prompts": EQ.N_PROMPTS,
                      "max_tokens": EQ.MAX_TOKENS, "vllm": vllm.__version__,
                      "runner_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                      "stages": stages, "multicast_off": MULTICAST_OFF}, "bench": {}}
    base, toks = EQ.tiny_setup()
    if "eq" in stages:
        run = lambda name, *a, **k: eq_run(name, res, out_dir, base, toks, *a, **k)  # noqa: E731
        run("fp32_nospec_eager", "float32", "TRITON_ATTN", "nospec", eager=True)
        ref = res["fp32_nospec_eager"].get("tokens")
        profile = EQ.write_profile(out_dir, "fp32_tp2", toks, ref) if ref else None
        for name in ("fp32_ddtree_graphs", "fp32_ddtree_graphs_again"):
            run(name, "float32", "TRITON_ATTN", "ddtree", profile=profile, sampled=True)
        run("bf16_fa_nospec_graphs", "bfloat16", "FLASH_ATTN", "nospec")
        ref16 = res["bf16_fa_nospec_graphs"].get("tokens")
        profile16 = EQ.write_profile(out_dir, "bf16_tp2", toks, ref16) if ref16 else None
        run("bf16_fa_ddtree_graphs", "bfloat16", "FLASH_ATTN", "ddtree", profile=profile16)
    if "bench" in stages:
        SB.make_models()
        for tp in (2, 1):
            for cfg in BENCH_CONFIGS:
                bench_run(cfg, tp, res, out_dir)
    if "control" in stages:
        eq_run("bf16_fa_dflash_graphs", res, out_dir, base, toks, "bfloat16", "FLASH_ATTN",
               "dflash")
    res["summary"] = summarize(res)
    res["step_table"] = step_table(res["bench"])
    res["wall_s"] = time.time() - START
    C.dump(os.path.join(out_dir, "tp_equality.json"), res)
    C.log("SUMMARY", json.dumps(res["summary"]))
    print("\n".join(res["step_table"]), flush=True)
    C.log(f"done in {res['wall_s']:.0f} s; {os.path.join(out_dir, 'tp_equality.json')}")


if __name__ == "__main__":
    main()
