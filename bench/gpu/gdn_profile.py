"""Where a DDTree step's time goes on the Qwen3.6-27B shape (torch profiler, V2, FULL
graphs): python3 bench/gpu/gdn_profile.py OUT_DIR [ddtree16|ddtreechain|dflash] -> the
top ops by CUDA and by CPU time over 16 decode steps at one request (profile_CFG.txt), every
kernel's count and device time (kernels_CFG.json: diff two configs with it) and the
timeline (trace_CFG.json.gz: host gaps)."""
import gzip, json, os, shutil, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gdn_step_bench as G  # noqa: E402
import common as C  # noqa: E402
import torch  # noqa: E402

out, cfg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "ddtree16")
os.makedirs(out, exist_ok=True)
G.make_models()
llm = G.engine(G.parse(cfg), [1])
toks = C.prompts(1, G.PROMPT, 2, 248000, seed=1)
C.generate(llm, toks, 17)
from torch.profiler import ProfilerActivity, profile  # noqa: E402
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    _, dt = C.generate(llm, toks, 17)
ka = p.key_averages()
with open(f"{out}/profile_{cfg}.txt", "w") as f:
    f.write(f"wall {dt * 1000:.1f} ms for 17 tokens\n")
    f.write(ka.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
kernels = {e.key: [e.count, round(e.self_device_time_total, 1)] for e in ka
           if e.self_device_time_total > 0}
with open(f"{out}/kernels_{cfg}.json", "w") as f:
    json.dump({"wall_ms": dt * 1000, "tokens": 17, "kernels": kernels}, f, indent=0)
p.export_chrome_trace(f"{out}/trace_{cfg}.json")
with open(f"{out}/trace_{cfg}.json", "rb") as a, gzip.open(f"{out}/trace_{cfg}.json.gz", "wb") as b:
    shutil.copyfileobj(a, b)
os.remove(f"{out}/trace_{cfg}.json")
print(open(f"{out}/profile_{cfg}.txt").read()[:9000])
