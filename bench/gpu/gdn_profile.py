"""Where a DDTree step's time goes on the Qwen3.6-27B shape (torch profiler, V2, FULL
graphs): python3 bench/gpu/gdn_profile.py OUT_DIR [ddtree16|ddtreechain|dflash] [--first]
-> the top ops by CUDA and by CPU time over 16 decode steps at one request
(profile_CFG.txt), every kernel's count and device time (kernels_CFG.json: diff two
configs with it) and the timeline (trace_CFG.json.gz: host gaps).
--first: a request's first steps instead (the prefill of a fresh 512-token prompt, its
first draft and two decode steps; run 20's first step was 46 ms longer in DDTree's
engine): 4 fresh prompts one at a time, each timed (unprofiled, then 4 more profiled),
written as *_CFG_first.*."""
import gzip, json, os, shutil, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gdn_step_bench as G  # noqa: E402
import common as C  # noqa: E402
import torch  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--first"]
first = "--first" in sys.argv[1:]
out, cfg = args[0], (args[1] if len(args) > 1 else "ddtree16")
tag = f"{cfg}_first" if first else cfg
os.makedirs(out, exist_ok=True)
G.make_models()
llm = G.engine(G.parse(cfg), [1])
toks = C.prompts(1, G.PROMPT, 2, 248000, seed=1)
C.generate(llm, toks, 17)
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def fresh(seed):  # a new prompt each time: no prefix-cache hit on the prefill
    return C.prompts(1, G.PROMPT, 2, 248000, seed=seed)


walls = [C.generate(llm, fresh(100 + i), 3)[1] * 1000 for i in range(4)] if first else []
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    if first:
        t0 = time.perf_counter()
        for i in range(4):
            C.generate(llm, fresh(200 + i), 3)
        dt, n_tok = time.perf_counter() - t0, 12
    else:
        _, dt = C.generate(llm, toks, 17)
        n_tok = 17
ka = p.key_averages()
with open(f"{out}/profile_{tag}.txt", "w") as f:
    f.write(f"wall {dt * 1000:.1f} ms for {n_tok} tokens\n")
    if first:
        f.write("unprofiled requests (prefill + first draft + 2 steps), ms: "
                + ", ".join(f"{w:.1f}" for w in walls) + "\n")
    f.write(ka.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
kernels = {e.key: [e.count, round(e.self_device_time_total, 1)] for e in ka
           if e.self_device_time_total > 0}
with open(f"{out}/kernels_{tag}.json", "w") as f:
    json.dump({"wall_ms": dt * 1000, "tokens": n_tok, "request_walls_ms": walls,
               "kernels": kernels}, f, indent=0)
p.export_chrome_trace(f"{out}/trace_{tag}.json")
with open(f"{out}/trace_{tag}.json", "rb") as a, gzip.open(f"{out}/trace_{tag}.json.gz", "wb") as b:
    shutil.copyfileobj(a, b)
os.remove(f"{out}/trace_{tag}.json")
print(open(f"{out}/profile_{tag}.txt").read()[:9000])
