"""The verify forward's GEMMs per row count M on the Qwen3-8B shape (#29: which GEMM
kernel runs at each M, and what 65 rows cost against 16).  No vLLM: vLLM's unquantized
linear layers call torch.nn.functional.linear on CUDA (cuBLAS), so this times exactly
those calls, bf16, with the whole model's weights resident (36 layers of qkv, o,
gate_up, down, then the LM head: 15 GB, so no weight sits in L2 between its uses).

    python3 bench/gpu/gemm_by_m.py OUT_DIR [--ms 1,16,17,...] [--rounds 5]

-> gemm_by_m.json and a table: per M, the step's GEMM time (one CUDA graph of all 145
GEMMs, replayed; median and spread over rounds), each layer type's time and the
kernel cuBLAS picked for it (torch profiler, eager), and the ratio to M = 16."""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

H, I, V, LAYERS = 4096, 12288, 151936, 36
QKV = (32 + 2 * 8) * 128
SHAPES = {"qkv": (QKV, H), "o": (H, 32 * 128), "gate_up": (2 * I, H), "down": (H, I)}
MS = [1, 2, 16, 17, 31, 32, 33, 48, 63, 64, 65, 66, 80, 96, 128, 130]


def arg(name, default):
    a = sys.argv
    return a[a.index(name) + 1] if name in a else default


def weights(dev):
    g = torch.Generator(device=dev).manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, device=dev, generator=g, dtype=torch.float32) * 0.02).bfloat16()
    layers = [{k: w(*s) for k, s in SHAPES.items()} for _ in range(LAYERS)]
    return layers, w(V, H)


def forward(x, layers, head, ys):
    """The step's GEMMs in order; outputs into preallocated buffers (graph-safe)."""
    F = torch.nn.functional
    for ly in layers:
        torch.matmul(x, ly["qkv"].t(), out=ys["qkv"])
        torch.matmul(ys["o_in"], ly["o"].t(), out=ys["o"])
        torch.matmul(x, ly["gate_up"].t(), out=ys["gate_up"])
        torch.matmul(ys["down_in"], ly["down"].t(), out=ys["down"])
    ys["logits"] = F.linear(x, head)


def buffers(m, dev):
    z = lambda *s: torch.randn(*s, device=dev).bfloat16()  # noqa: E731
    return {"qkv": z(m, QKV), "o_in": z(m, 32 * 128), "o": z(m, H), "gate_up": z(m, 2 * I),
            "down_in": z(m, I), "down": z(m, H)}


def graph_ms(m, layers, head, reps, dev):
    x, ys = torch.randn(m, H, device=dev).bfloat16(), buffers(m, dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            forward(x, layers, head, ys)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        forward(x, layers, head, ys)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def kernels(m, layers, head, dev):
    """Per layer type: the kernel name(s) cuBLAS ran and their device time (us)."""
    from torch.profiler import ProfilerActivity, profile

    x, ys = torch.randn(m, H, device=dev).bfloat16(), buffers(m, dev)
    forward(x, layers, head, ys)
    torch.cuda.synchronize()
    out = {}
    parts = [("qkv", x, "qkv"), ("o", ys["o_in"], "o"), ("gate_up", x, "gate_up"),
             ("down", ys["down_in"], "down")]
    for name, inp, key in parts + [("lm_head", x, None)]:
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for ly in layers[:8]:
                if key is None:
                    torch.nn.functional.linear(inp, head)
                else:
                    torch.matmul(inp, ly[key].t(), out=ys[key])
            torch.cuda.synchronize()
        evs = [e for e in p.key_averages() if e.self_device_time_total > 0]
        n = 8
        out[name] = {"kernels": sorted({e.key[:120] for e in evs}),
                     "us": round(sum(e.self_device_time_total for e in evs) / n, 2)}
    return out


def main():
    out_dir = sys.argv[1]
    ms = [int(v) for v in arg("--ms", ",".join(map(str, MS))).split(",")]
    rounds = int(arg("--rounds", "5"))
    os.makedirs(out_dir, exist_ok=True)
    dev = "cuda"
    layers, head = weights(dev)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rounds": rounds, "rows": {}}
    times = {m: [] for m in ms}
    for _ in range(rounds):  # rounds interleave the Ms: drift hits them alike
        for m in ms:
            times[m].append(graph_ms(m, layers, head, 10, dev))
    for m in ms:
        res["rows"][str(m)] = {"step_ms": times[m], "per_type": kernels(m, layers, head, dev)}
    with open(os.path.join(out_dir, "gemm_by_m.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))


def table(res) -> str:
    rows = res["rows"]
    base = statistics.median(rows["16"]["step_ms"]) if "16" in rows else None
    types = ["qkv", "o", "gate_up", "down", "lm_head"]
    lines = [f"{res['device']}, torch {res['torch']}, {res['rounds']} rounds",
             "| M | GEMMs of a step, ms (min-max) | / M = 16 | " + " | ".join(
                 f"{t} us" for t in types) + " |",
             "|---:|---|---:|" + "---:|" * len(types)]
    for m, r in rows.items():
        med = statistics.median(r["step_ms"])
        rel = f"{med / base:.3f}" if base else "-"
        lines.append(f"| {m} | {med:.3f} ({min(r['step_ms']):.3f}-{max(r['step_ms']):.3f}) "
                     f"| {rel} | " + " | ".join(f"{r['per_type'][t]['us']:.1f}" for t in types)
                     + " |")
    lines.append("")
    lines.append("kernels per M and layer type:")
    for m, r in rows.items():
        for t in types:
            lines.append(f"  M {m:>4} {t:<8} {'; '.join(r['per_type'][t]['kernels'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--table":
        print(table(json.load(open(sys.argv[2]))))
    else:
        main()
