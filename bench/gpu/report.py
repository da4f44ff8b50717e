"""Markdown tables and PNG plots from the H200 run's JSON files.

    python bench/gpu/report.py RESULTS_DIR [PLOT_DIR]
    python bench/gpu/report.py bench/results/RUN.tar.xz[/SUBFOLDER] [PLOT_DIR]
a run packed by bench/pack_results.py, unpacked to a temporary folder (e.g.
bench/results/run3.tar.xz, bench/results/run12_033.tar.xz/c3).
RESULTS_DIR holds step_bench.json, equality.json, kernel_bench.json (from run_all.sh) and
optionally repeat/r*.json (the repeat stage: alternating fresh processes) and
v2repeat/r*/step_bench.json (the v2repeat stage: the same on V2, with end-to-end runs;
gdn_device.sh's e2e stage writes the same as e2e/r*/step_bench.json).
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def load(d, name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None


def fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def step_tables(sb) -> str:
    out = []
    names = [k for k in sb if "steps" in sb[k]]
    batches = sorted({int(n) for k in names for n in sb[k]["steps"]})
    chain = sb.get("chain15", {}).get("steps", {})
    out.append("| config | N | step ms (median) | / chain15 | verify fwd | draft | tree build "
               "| sample (walk) | commit (GPU / CPU) | prepare (GPU / CPU) | tree machinery % |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in names:
        for n in batches:
            s = sb[k]["steps"].get(str(n))
            if not s or s.get("step_ms") is None:
                continue
            g, c = s["gpu_ms"], s["cpu_ms"]
            ref = chain.get(str(n), {}).get("step_ms")
            ratio = s["step_ms"] / ref if ref else None
            mach = None
            if k.startswith("ddtree"):
                parts = [g.get("tree_build"), g.get("walk"), g.get("commit"), g.get("prepare")]
                mach = 100 * sum(x or 0 for x in parts) / s["step_ms"]
            out.append(f"| {k} | {n} | {fmt(s['step_ms'])} | {fmt(ratio)} | "
                       f"{fmt(g.get('verify_forward'))} | {fmt(g.get('draft'))} | "
                       f"{fmt(g.get('tree_build'))} | {fmt(g.get('sample'))} "
                       f"({fmt(g.get('walk'), 3)}) | {fmt(g.get('commit'), 3)} / "
                       f"{fmt(c.get('commit'), 3)} | "
                       f"{fmt(g.get('prepare'), 3)} / {fmt(c.get('prepare'), 3)} | "
                       f"{fmt(mach, 1)} |")
    return "\n".join(out)


def _base(runs: list) -> str:
    """The chain config the rounds ran: chain15async (V2) or chain15."""
    return "chain15async" if any("chain15async" in r for r in runs) else "chain15"


def _median(xs):
    ok = sorted(x for x in xs if x)
    return ok[len(ok) // 2] if ok else None


def repeat_table(runs: list) -> str:
    """Rounds of alternating fresh processes: step ms per config and the ratio to the
    same round's chain (chain15async if the rounds ran it, else chain15)."""
    base = _base(runs)
    names = [k for k in runs[0] if "steps" in runs[0][k]]
    batches = sorted({int(n) for r in runs for k in names for n in r.get(k, {}).get("steps", {})})
    out = ["| config | N | " + " | ".join(f"round {i + 1} ms (/ chain)" for i in range(len(runs)))
           + " | median ms | median ratio |",
           "| --- | ---: |" + " ---: |" * (len(runs) + 2)]
    for k in names:
        for n in batches:
            ms, ratios = [], []
            for r in runs:
                s = r.get(k, {}).get("steps", {}).get(str(n), {}).get("step_ms")
                c = r.get(base, {}).get("steps", {}).get(str(n), {}).get("step_ms")
                ms.append(s)
                ratios.append(s / c if s and c else None)
            cells = " | ".join(f"{fmt(m)} ({fmt(q)})" for m, q in zip(ms, ratios))
            out.append(f"| {k} | {n} | {cells} | {fmt(_median(ms))} | "
                       f"{fmt(_median(ratios))} |")
    return "\n".join(out)


def _e2e_cells(runs: list, names) -> list:
    """The e2e cells (``<profile>_N<requests>``) the configs ran, by profile then batch."""
    return sorted({c for r in runs for k in names for c in r.get(k, {}).get("e2e", {})},
                  key=lambda c: (c.rsplit("_N", 1)[0], int(c.rsplit("_N", 1)[1])))


def e2e_repeat_table(runs: list) -> str:
    """Rounds of fresh processes, end to end: tokens/s per config, profile and batch,
    each round's ratio to the same round's chain, and the medians."""
    base = _base(runs)
    names = sorted({k for r in runs for k in r if r[k].get("e2e")})
    cells = _e2e_cells(runs, names)
    out = ["| config | cell | " + " | ".join(f"round {i + 1} tok/s (/ chain)"
                                            for i in range(len(runs)))
           + " | median tok/s | median ratio |", "| --- | --- |" + " ---: |" * (len(runs) + 2)]
    for k in names:
        for cell in cells:
            tps, ratios = [], []
            for r in runs:
                e = r.get(k, {}).get("e2e", {}).get(cell, {}).get("tok_per_s")
                c = r.get(base, {}).get("e2e", {}).get(cell, {}).get("tok_per_s")
                tps.append(e)
                ratios.append(e / c if e and c else None)
            if not any(tps):
                continue
            row = " | ".join(f"{fmt(t, 0)} ({fmt(q)})" for t, q in zip(tps, ratios))
            out.append(f"| {k} | {cell} | {row} | {fmt(_median(tps), 0)} | "
                       f"{fmt(_median(ratios))} |")
    return "\n".join(out)


def after_first_step(e: dict, n: int) -> float | None:
    """Tokens/s of an e2e cell with its first step left out (its timeline's first entry:
    the prefill and the first draft; the n requests' first tokens go with it)."""
    t = e.get("timeline") or []
    first = (t[0][3] or 0) / 1e3 if t else None
    if first is None or e["seconds"] - first <= 0:
        return None
    return (e["tokens"] - n) / (e["seconds"] - first)


def e2e_steady_table(runs: list) -> str:
    """The e2e ratios with each cell's first step left out of both engines (tokens after
    it over time after it): where a short cell's first step, which varies between
    rounds, decides the ratio (run 19: p90, 128 tokens a request)."""
    base = _base(runs)
    names = sorted({k for r in runs for k in r if r[k].get("e2e") and k != base})
    cells = _e2e_cells(runs, names)
    out = ["| config | cell | " + " | ".join(f"round {i + 1} / chain" for i in range(len(runs)))
           + " | median |", "| --- | --- |" + " ---: |" * (len(runs) + 1)]
    for k in names:
        for cell in cells:
            n = int(cell.rsplit("_N", 1)[1])
            ratios = []
            for r in runs:
                e = r.get(k, {}).get("e2e", {}).get(cell)
                c = r.get(base, {}).get("e2e", {}).get(cell)
                a = after_first_step(e, n) if e else None
                b = after_first_step(c, n) if c else None
                ratios.append(a / b if a and b else None)
            if any(ratios):
                out.append(f"| {k} | {cell} | " + " | ".join(fmt(q, 3) for q in ratios)
                           + f" | {fmt(_median(ratios), 3)} |")
    return "\n".join(out)


def e2e_table(sb) -> str:
    out = ["| config | profile | N | tokens/s | tau (tokens / request-step) | steps | "
           "mismatches vs pi-chain |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for k in sb:
        for key, e in sorted(sb[k].get("e2e", {}).items()):
            prof, n = key.rsplit("_N", 1)
            out.append(f"| {k} | {prof} | {n} | {fmt(e['tok_per_s'], 1)} | "
                       f"{fmt(e.get('tau'))} | {e['decode_steps']} | "
                       f"{e['mismatches_vs_pi_chain']} |")
    return "\n".join(out)


def _cells(runs: list):
    """(round, config, cell, its e2e record) of every e2e cell of every round."""
    for i, run in enumerate(runs, 1):
        for name, v in run.items():
            for cell, e in sorted(v.get("e2e", {}).items()):
                yield i, name, cell, e


def arms_table(runs: list) -> str:
    """The tree-vs-chain choice per e2e cell and batch size (step_bench's ``arms``):
    steps played per arm, ms per step, tokens per step of each arm measured on the same
    tree steps, the tree's edge in standard errors (``edge``; the tree leads above 1),
    what a switch cost beyond the new arm's step (``switch_ms``, over ``switches``),
    and the tokens of the smaller trees priced there (``subtrees``)."""
    out = ["| round | config | cell | N | tree / chain steps | ms tree / chain | "
           "tokens tree / chain | edge | switch ms (switches) | "
           "smaller trees (b: tokens) |",
           "| ---: | --- | --- | ---: | --- | --- | --- | ---: | ---: | --- |"]
    for i, name, cell, e in _cells(runs):
        n_cell = cell.rsplit("_N", 1)[1]
        for n, a in sorted((e.get("arms") or {}).items()):
            if n != n_cell and int(n) > int(n_cell):
                continue  # batch sizes the cell never ran
            tree = next((x for k, x in a.items() if k.startswith("tree")), None)
            chain = next((x for k, x in a.items() if k.startswith("chain")), None)
            if not tree or not chain or not (tree["steps"] or chain["steps"]):
                continue
            subs = ", ".join(f"{b}: {t}" for b, t in (a.get("subtrees") or {}).items())
            sw = f"{fmt(a['switch_ms'])} ({a['switches']})" if a.get("switches") else "-"
            out.append(f"| {i} | {name} | {cell} | {n} | {tree['steps']} / "
                       f"{chain['steps']} | {fmt(tree['ms'])} / {fmt(chain['ms'])} | "
                       f"{fmt(tree['expected'])} / {fmt(chain['expected'])} | "
                       f"{fmt(a.get('edge'))} | {sw} | {subs or '-'} |")
    return "\n".join(out)


def timeline_stats(timeline: list) -> dict | None:
    """From step_bench's per-step timeline ([requests, tokens, decode width, wall ms]) of
    one cell: pure decode steps by width (the widest of two widths is the tree),
    each arm's steady wall (median over steps that follow a step of the same width),
    the walls of the steps that follow a switch, the first 3 tree steps, and what all
    steps cost beyond their arm's steady wall (ms, and % of the cell's decode time)."""
    dec = [(k, w) for _, _, k, w in timeline if k and w is not None]
    if not dec:
        return None
    widths = sorted({k for k, _ in dec})
    tree = widths[-1] if len(widths) > 1 else None
    steady = {k: _median([w for (a, w), (b, _) in zip(dec[1:], dec) if a == b == k])
              for k in widths}
    after = {k: [w for (a, w), (b, _) in zip(dec[1:], dec) if a == k and b != k]
             for k in widths}
    excess = sum(w - (steady[k] or w) for k, w in dec)
    total = sum(w for _, w in dec)
    return {"widths": widths, "tree": tree,
            "steps": {k: sum(1 for a, _ in dec if a == k) for k in widths},
            "steady_ms": steady,
            "after_switch_ms": {k: (round(statistics.fmean(v), 3) if v else None, len(v))
                                for k, v in after.items()},
            "first_tree_ms": round(statistics.fmean([w for k, w in dec if k == tree][:3]), 3)
            if tree is not None else None,
            "excess_ms": round(excess, 3),
            "excess_pct": round(100 * excess / total, 2) if total else None}


def _chain_steady(run: dict, cell: str) -> float | None:
    """The steady step (timeline median) of the DFlash chain config's same cell in the
    same round: what the choice's chain steps should cost."""
    for name, v in run.items():
        e = v.get("e2e", {}).get(cell) if name.startswith("chain") else None
        st = timeline_stats(e.get("timeline") or []) if e else None
        if st and len(st["widths"]) == 1:
            return st["steady_ms"][st["widths"][0]]
    return None


def timeline_table(runs: list) -> str:
    """Per e2e cell of a config with two widths (the choice): where the time went, and
    the DFlash chain's own steady step on the same cell (same round)."""
    out = ["| round | config | cell | steps tree / chain | steady ms tree / chain | "
           "DFlash chain steady ms | after a switch: into tree / into chain (n) | "
           "first 3 tree steps ms | beyond steady: ms (% of the cell) |",
           "| ---: | --- | --- | --- | --- | ---: | --- | ---: | --- |"]
    for i, name, cell, e in _cells(runs):
        st = timeline_stats(e.get("timeline") or [])
        if not st or st["tree"] is None:
            continue
        t, c = st["tree"], st["widths"][0]
        (ti, tn), (ci, cn) = st["after_switch_ms"][t], st["after_switch_ms"][c]
        out.append(f"| {i} | {name} | {cell} | {st['steps'][t]} / {st['steps'][c]} | "
                   f"{fmt(st['steady_ms'][t])} / {fmt(st['steady_ms'][c])} | "
                   f"{fmt(_chain_steady(runs[i - 1], cell))} | "
                   f"{fmt(ti)} / {fmt(ci)} ({tn} / {cn}) | {fmt(st['first_tree_ms'])} | "
                   f"{fmt(st['excess_ms'], 1)} ({fmt(st['excess_pct'], 1)}) |")
    return "\n".join(out)


def kernel_table(kb) -> str:
    out = ["| N | B | tree kernel us | FA3 causal us | extra per step, 36 layers (ms) |",
           "| ---: | ---: | ---: | ---: | ---: |"]
    for r in kb:
        out.append(f"| {r['N']} | {r['B']} | {fmt(r['tree_us'], 1)} | "
                   f"{fmt(r['fa3_causal_us'], 1)} | {fmt(r['x36_layers_extra_ms'], 3)} |")
    return "\n".join(out)


def plots(sb, plot_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    names = [k for k in sb if "steps" in sb[k]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in names:
        pts = sorted((int(n), s["step_ms"]) for n, s in sb[k]["steps"].items()
                     if s.get("step_ms"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title("vLLM 0.20.2, H200, Qwen3-8B shape: verify step time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(plot_dir, "step_time.png"), dpi=120)
    plt.close(fig)

    # breakdown at batch 1
    phases = ["verify_forward", "draft", "tree_build", "sample", "commit", "prepare"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [k for k in names if sb[k]["steps"].get("1", {}).get("step_ms")]
    bottom = [0.0] * len(xs)
    for ph in phases:
        vals = [sb[k]["steps"]["1"]["gpu_ms"].get(ph) or 0.0 for k in xs]
        if ph == "draft":  # the tree build is inside the draft span
            vals = [v - (sb[k]["steps"]["1"]["gpu_ms"].get("tree_build") or 0.0)
                    for v, k in zip(vals, xs)]
        ax.bar(xs, vals, bottom=bottom, label=ph if ph != "draft" else "draft (w/o build)")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(xs, [sb[k]["steps"]["1"]["step_ms"] for k in xs], "k_", markersize=30,
            label="step wall")
    ax.set_ylabel("ms (GPU spans, batch 1)")
    ax.set_title("Step breakdown, batch 1")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=30)
    fig.tight_layout()
    fig.savefig(os.path.join(plot_dir, "breakdown_b1.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sb:
        e2e = sb[k].get("e2e", {})
        pts = sorted((key.rsplit("_N", 1)[0], v["tok_per_s"]) for key, v in e2e.items()
                     if key.endswith("_N1"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
    ax.set_ylabel("tokens/s (batch 1)")
    ax.set_xlabel("synthetic drafter profile (P(true token at rank 0))")
    ax.set_title("End-to-end, synthetic drafter, batch 1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(plot_dir, "e2e_b1.png"), dpi=120)
    plt.close(fig)


def e2e_by_batch_plot(sb, plot_dir, tag):
    """tokens/s vs batch, one column per synthetic-drafter profile (step_bench part (c)
    with BENCH_E2E_ALL=1), every config side by side; a second row: each config over
    the chain config (the first whose name starts with 'chain')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({k.rsplit("_N", 1)[0] for v in sb.values() for k in v.get("e2e", {})})
    base = next((k for k in sb if k.startswith("chain")), None)
    fig, axes = plt.subplots(2, len(profiles), figsize=(4.2 * len(profiles), 7.2),
                             squeeze=False)

    def points(v, prof):
        return sorted((int(k.rsplit("_N", 1)[1]), e["tok_per_s"])
                      for k, e in v.get("e2e", {}).items() if k.rsplit("_N", 1)[0] == prof)

    for col, prof in enumerate(profiles):
        top, low = axes[0][col], axes[1][col]
        ref = dict(points(sb[base], prof)) if base else {}
        for name, v in sb.items():
            pts = points(v, prof)
            if not pts:
                continue
            style = "--" if name.startswith("chain") else "-"
            top.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                     linestyle=style)
            rat = [(n, t / ref[n]) for n, t in pts if ref.get(n)]
            low.plot([p[0] for p in rat], [p[1] for p in rat], marker="o", linestyle=style)
        for ax in (top, low):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        top.set_title(f"{prof} drafter")
        top.set_ylabel("tokens/s")
        low.set_ylabel(f"/ {base}" if base else "")
        low.set_xlabel("batch (requests)")
        low.axhline(1.0, color="gray", linewidth=0.8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"End-to-end tokens/s vs batch ({tag}; one run per point)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    os.makedirs(plot_dir, exist_ok=True)
    path = os.path.join(plot_dir, f"e2e_by_batch_{tag}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    d = sys.argv[1]
    plot_dir = sys.argv[2] if len(sys.argv) > 2 else None
    archive, tar, sub = d.partition(".tar.xz")
    if tar:  # a run packed by bench/pack_results.py (and a folder inside it)
        import tempfile

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from pack_results import extract

        with tempfile.TemporaryDirectory() as tmp:
            return report(os.path.join(extract(archive + tar, tmp), sub.strip("/")),
                          plot_dir)
    return report(d, plot_dir)


def report(d, plot_dir=None):
    """Print the tables of results folder D (and write plots to PLOT_DIR)."""
    sb, eq, kb = load(d, "step_bench.json"), load(d, "equality.json"), load(d, "kernel_bench.json")
    if eq:
        print("### Equality\n")
        print("```\n" + json.dumps(eq.get("summary"), indent=1) + "\n```")
        for k, v in eq.items():
            if isinstance(v, dict) and ("walk" in v or "error" in v):
                print(k, json.dumps({x: v.get(x) for x in ("walk", "eager_tree_attention_calls",
                                                              "seconds")})[:600])
                if "error" in v:
                    print("ERROR", v["error"][-600:])
    if sb:
        print("\n### Step time\n")
        print(step_tables(sb))
        print("\n### End-to-end\n")
        print(e2e_table(sb))
        for k, v in sb.items():
            if "error" in v:
                print("\nERROR", k, v["error"][-800:])
        if plot_dir:
            plots(sb, plot_dir)
    rep = sorted(os.listdir(os.path.join(d, "repeat"))) if os.path.isdir(
        os.path.join(d, "repeat")) else []
    if rep:
        print("\n### Repeated step time (fresh process per config and round)\n")
        print(repeat_table([load(os.path.join(d, "repeat"), f) for f in rep]))
    # v2repeat/r*/ (run_all.sh's stage) or e2e/r*/ (gdn_device.sh's e2e stage)
    v2 = next((os.path.join(d, x) for x in ("v2repeat", "e2e")
               if os.path.isdir(os.path.join(d, x))), None)
    rounds = [load(os.path.join(v2, r), "step_bench.json")
              for r in sorted(os.listdir(v2))] if v2 else []
    rounds = [r for r in rounds if r]
    if rounds:
        print("\n### V2, repeated (fresh process per config and round): step time\n")
        print(repeat_table(rounds))
        print("\n### V2, repeated: end to end\n")
        print(e2e_repeat_table(rounds))
        print("\n### V2, repeated: end to end without each cell's first step\n")
        print(e2e_steady_table(rounds))
        print("\n### V2, repeated: the tree-vs-chain choice per cell\n")
        print(arms_table(rounds))
        print("\n### V2, repeated: where a cell's time went (step timeline)\n")
        print(timeline_table(rounds))
    if kb:
        print("\n### Tree kernel vs FA3\n")
        print(kernel_table(kb))


if __name__ == "__main__":
    main()
