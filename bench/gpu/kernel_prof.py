"""Where a decode step's GPU time goes, by kernel (#29's per-phase table): the torch
profiler over a short generation minus the same over its prefill alone, divided by the
steps between them, so only decode steps count (CUPTI sees the kernels inside CUDA graph
replays too).  step_bench.py writes kernels_<config>_N<n>.json with BENCH_TPROFILE=1;

    python3 bench/gpu/kernel_prof.py A.json B.json [...]

prints per-step device time by category (GEMMs, attention, our tree kernels, ...) for
each file side by side, then the kernels whose per-step time differs most between the
first two."""

from __future__ import annotations

import json
import re
import sys

# first match wins; ours: the Triton kernels of patches/ddtree/payload
CATEGORIES = [
    ("tree kernels (ours)", r"^_(tree_attn|tree|build|mask|walk_greedy|walk_sampled|prepare|"
                            r"commit|compact|move_rows|paired|top1|select|part|pack|prefix|"
                            r"mass_sums|uniforms|verify|conv|conv_commit)_kernel"),
    # before GEMM: FA3's kernels are cutlass templates
    ("attention (vLLM)", r"flash|fmha|attn|attention|paged"),
    ("GEMM (cuBLAS / CUTLASS)", r"gemm|nvjet|cutlass|xmma|cublas|splitk"),
    ("top-k / sort", r"topk|sort|radix|bitonic|argmax|max_reduce"),
    ("norm", r"norm"),
    ("activation", r"silu|act_and_mul|gelu"),
    ("rotary", r"rotary|rope"),
    ("copy / fill / index", r"copy|fill|index|gather|scatter|cat|memcpy|memset|"
                            r"elementwise|vectorized|unrolled"),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, name if cat.endswith("(ours)") else low):
            return cat
    return "other"


def collect(prof) -> dict:
    """{kernel name: [count, device us]} and {op: self CPU us} of a finished profiler."""
    ka = prof.key_averages()
    return {"kernels": {e.key: [e.count, e.self_device_time_total] for e in ka
                        if e.self_device_time_total > 0},
            "cpu": {e.key: e.self_cpu_time_total for e in ka if e.self_cpu_time_total > 0}}


def per_step(full: dict, prefill: dict, steps: int) -> dict:
    """(full - prefill) / steps for each kernel and op; negatives (noise) clamp to 0."""
    out = {"kernels": {}, "cpu": {}}
    for k, (c, us) in full["kernels"].items():
        c0, us0 = prefill["kernels"].get(k, [0, 0.0])
        if us - us0 > 0:
            out["kernels"][k] = [(c - c0) / steps, (us - us0) / steps]
    for k, us in full["cpu"].items():
        d = us - prefill["cpu"].get(k, 0.0)
        if d > 0:
            out["cpu"][k] = d / steps
    return out


def step_kernels(C, llm, hooks, n, new, prompt_len, path):
    """Profile a prefill-only generation and a ``new``-token one (fresh prompts, no
    prefix-cache hits) and write the per-decode-step difference to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    runs = []
    for seed, m in ((500 + n, 1), (600 + n, new)):
        toks = C.prompts(n, prompt_len, 1000, 100000, seed=seed)
        hooks.reset()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            C.generate(llm, toks, m)
        runs.append((collect(p), len(hooks.steps)))
    (pre, s0), (full, s1) = runs
    steps = max(1, s1 - s0)
    res = {"requests": n, "new_tokens": new, "steps": steps, **per_step(full, pre, steps)}
    with open(path, "w") as f:
        json.dump(res, f)
    return res


def by_category(res: dict) -> dict:
    out = {}
    for k, (c, us) in res["kernels"].items():
        cat = category(k)
        out.setdefault(cat, [0.0, 0.0])
        out[cat][0] += c
        out[cat][1] += us
    return out


def table(files: list) -> str:
    runs = [json.load(open(f)) for f in files]
    cats = [c for c, _ in CATEGORIES] + ["other"]
    bc = [by_category(r) for r in runs]
    head = " | ".join(f"{f.rsplit('/', 1)[-1][8:-5]} ms (launches)" for f in files)
    lines = [f"| per decode step | {head} |", "|---|" + "---:|" * len(files)]
    for cat in cats:
        if any(cat in b for b in bc):
            lines.append(f"| {cat} | " + " | ".join(
                f"{b.get(cat, [0, 0])[1] / 1e3:.3f} ({b.get(cat, [0, 0])[0]:.0f})"
                for b in bc) + " |")
    lines.append("| **all kernels** | " + " | ".join(
        f"**{sum(v[1] for v in b.values()) / 1e3:.3f}** ({sum(v[0] for v in b.values()):.0f})"
        for b in bc) + " |")
    lines.append("| steps profiled | " + " | ".join(str(r["steps"]) for r in runs) + " |")
    if len(runs) >= 2:
        a, b = runs[0]["kernels"], runs[1]["kernels"]
        diff = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, [0, 0])[1]
                                                          - a.get(k, [0, 0])[1]))
        lines += ["", f"kernels by |difference| per step, us ({files[1]} - {files[0]}):"]
        for k in diff[:25]:
            x, y = a.get(k, [0, 0]), b.get(k, [0, 0])
            lines.append(f"  {y[1] - x[1]:+9.1f}  {x[1]:8.1f} -> {y[1]:8.1f}  "
                         f"({x[0]:.0f} -> {y[0]:.0f})  [{category(k)}] {k[:100]}")
        ca, cb = runs[0]["cpu"], runs[1]["cpu"]
        top = sorted(set(ca) | set(cb), key=lambda k: -abs(cb.get(k, 0) - ca.get(k, 0)))
        lines += ["", "host ops by |difference| of self CPU us per step:"]
        for k in top[:15]:
            lines.append(f"  {cb.get(k, 0) - ca.get(k, 0):+9.1f}  {ca.get(k, 0):8.1f} -> "
                         f"{cb.get(k, 0):8.1f}  {k[:90]}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
