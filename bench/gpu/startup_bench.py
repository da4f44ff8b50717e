"""Engine start-up: DDTree against the DFlash chain at the same max_num_seqs (issue #29).

    python bench/gpu/startup_bench.py OUT [--configs chain15async,ddtree64autoasync]
                                          [--seqs 1,8,64,256] [--rounds 2] [--fresh]

Every engine is built in a fresh process (`step_bench.engine`: the Qwen3-8B shape, or
the Qwen3.6-27B shape with BENCH_SHAPE=qwen36_27b; FULL_DECODE_ONLY graphs) with the
capture sizes vLLM picks for that max_num_seqs, as a user gets them, and timed until
`LLM()` returns.  Each config compiles into its own Triton cache (CACHE_ROOT/<config>,
outside OUT so that the caches do not travel back with the results; --fresh empties
them first, so a session spread over calls passes it once): an engine that finds its
cache empty is "cold" (Triton compiles its kernels), later ones "warm"; each record
lists the Triton kernels its engine compiled (variants new to the cache, by name).
Order: rounds x max_num_seqs x configs, alternating.
Writes OUT/startup.json and prints a table (warm medians, min-max, and the ratio of each
config to the first one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE = re.compile(r"Graph capturing finished in (\d+) secs?, took ([\d.]+) GiB")
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
LOAD = re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) s")
SIZES = re.compile(r"""['"]cudagraph_capture_sizes['"]: \[([\d, ]*)\]""")


def parse_log(text: str) -> dict:
    """What vLLM's start-up log says: graph captures (seconds, GiB, one per model that
    captures), the engine's init time, model loading, how many capture sizes it chose (the longest list it logs)."""
    caps = [(int(a), float(b)) for a, b in CAPTURE.findall(text)]
    init = [float(x) for x in INIT.findall(text)]
    load = [float(b) for _, b in LOAD.findall(text)]
    sizes = [len([x for x in m.split(",") if x.strip()]) for m in SIZES.findall(text)]
    return {"captures": len(caps), "capture_s": sum(a for a, _ in caps),
            "capture_gib": round(sum(b for _, b in caps), 2),
            "init_engine_s": init[-1] if init else None,
            "load_s": round(sum(load), 2) if load else None,
            "capture_sizes": max(sizes) if sizes and max(sizes) else None}


def compiled(cache: str) -> dict:
    """Triton kernels compiled into a cache folder, by kernel name (one .cubin per
    compiled variant): which kernels a start-up compiles, and how many variants each."""
    out: dict = {}
    for _, _, files in os.walk(cache):
        for f in files:
            if f.endswith(".cubin"):
                out[f[:-6]] = out.get(f[:-6], 0) + 1
    return out


def one(cfg: str, seqs: int) -> None:
    """The child: build the engine, print its start-up time, leave without teardown."""
    sys.path.insert(0, HERE)
    import step_bench as S

    spec = S.parse(cfg)
    k = spec["k"]
    t0 = time.perf_counter()
    S.engine(spec, max_num_seqs=seqs, max_num_batched_tokens=max(8192, seqs * (1 + k)),
             compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})
    print("STARTUP " + json.dumps({"start_s": round(time.perf_counter() - t0, 2)}), flush=True)
    os._exit(0)


def run(out: str, cfg: str, seqs: int, timeout: float, cache_root: str) -> dict:
    cache = os.path.join(cache_root, cfg)
    cold = not (os.path.isdir(cache) and os.listdir(cache))
    before = compiled(cache)
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", cfg, str(seqs)],
                           env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:  # its output may be bytes despite text=True
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                       for x in (e.stdout, e.stderr))
        rc = "timeout"
    with open(os.path.join(out, f"log_{cfg}_{seqs}_{int(time.time())}.txt"), "w") as f:
        f.write(text)
    m = re.search(r"STARTUP (\{.*\})", text)
    rec = {"config": cfg, "max_num_seqs": seqs, "cache": "cold" if cold else "warm", "rc": rc,
           "process_s": round(time.perf_counter() - t0, 2),
           "start_s": json.loads(m.group(1))["start_s"] if m else None}
    rec.update(parse_log(text))
    after = compiled(cache)  # what this engine compiled: variants new to the cache
    rec["compiled"] = {k: v - before.get(k, 0) for k, v in sorted(after.items())
                       if v > before.get(k, 0)}
    rec["compiled_total"] = sum(rec["compiled"].values())
    return rec


def table(records: list[dict]) -> str:
    """Warm start-up per config and max_num_seqs: median (min-max), the ratio to the first
    config's warm median, the graph captures; then each cold start."""
    cfgs = list(dict.fromkeys(r["config"] for r in records))
    seqs = sorted({r["max_num_seqs"] for r in records})
    out = ["| config | max_num_seqs | warm start s, median (min-max) | / " + cfgs[0]
           + " | capture s | capture GiB | capture sizes | cold start s |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    base = {}
    for cfg in cfgs:
        for n in seqs:
            rs = [r for r in records if r["config"] == cfg and r["max_num_seqs"] == n]
            warm = [r["start_s"] for r in rs if r["cache"] == "warm" and r["start_s"]]
            cold = [r["start_s"] for r in rs if r["cache"] == "cold" and r["start_s"]]
            med = statistics.median(warm) if warm else None
            if cfg == cfgs[0]:
                base[n] = med
            ratio = f"{med / base[n]:.2f}" if med and base.get(n) else "-"
            cap = [r for r in rs if r["cache"] == "warm" and r["start_s"]]
            last = cap[-1] if cap else {}
            spread = f"{med:.1f} ({min(warm):.1f}-{max(warm):.1f})" if warm else "-"
            fails = [str(r["rc"]) for r in rs if r["start_s"] is None]
            out.append(f"| {cfg} | {n} | {spread}{' failed: ' + ','.join(fails) if fails else ''}"
                       f" | {ratio} | {last.get('capture_s', '-')} | {last.get('capture_gib', '-')}"
                       f" | {last.get('capture_sizes', '-')} | "
                       f"{', '.join(f'{c:.1f}' for c in cold) or '-'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--configs", default="chain15async,ddtree64autoasync")
    ap.add_argument("--seqs", default="1,8,64,256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--cache-root", default="/tmp/startup_triton")
    ap.add_argument("--fresh", action="store_true", help="empty the Triton caches first")
    ap.add_argument("--one", nargs=2, metavar=("CONFIG", "MAX_NUM_SEQS"))
    a = ap.parse_args(argv)
    if a.one:
        one(a.one[0], int(a.one[1]))
        return 0
    if not a.out:
        ap.error("OUT is required")
    os.makedirs(a.out, exist_ok=True)
    sys.path.insert(0, HERE)
    import step_bench as S

    S.make_models()
    cfgs, seqs = a.configs.split(","), [int(x) for x in a.seqs.split(",")]
    for cfg in cfgs if a.fresh else ():
        shutil.rmtree(os.path.join(a.cache_root, cfg), ignore_errors=True)
    path, records = os.path.join(a.out, "startup.json"), []
    for r in range(a.rounds):
        for n in seqs:
            for cfg in cfgs:
                rec = run(a.out, cfg, n, a.timeout, a.cache_root)
                rec["round"] = r + 1
                records.append(rec)
                print(json.dumps(rec), flush=True)
                with open(path, "w") as f:
                    json.dump(records, f, indent=1)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
