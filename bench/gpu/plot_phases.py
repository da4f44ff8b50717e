"""#29's two plots from a run's raw files: a decode step's kernel time as stacked bars per
config and batch size (kernel_prof.py's kernels_<config>_N<n>.json), and tokens/s / the
DFlash chain's against the number of requests per config and profile (gdn_device.sh's
e2e logs, each call against its own chain, medians over the rounds; e2e_logs.py).

    python bench/gpu/plot_phases.py --kprof DIR --e2e DIR [DIR ...] --out DIR [--tag run23]

Writes OUT/step_phases_<tag>.png and OUT/e2e_by_batch_<tag>.png (matplotlib; the
series themselves come from ``step_phases`` / ``throughput``, which need none).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_logs  # noqa: E402
import kernel_prof  # noqa: E402

# the bars' layers: tree attention (and its split combine) counts as attention
PHASES = ["GEMMs", "attention (FA3 / tree)", "tree build, select, walk, commit",
          "norm, activation, rotary", "other"]
_NAME = re.compile(r"kernels_(.+)_N(\d+)\.json$")


def phase(kernel: str) -> str:
    if kernel.startswith(("_tree_attn_kernel", "_combine")):
        return PHASES[1]
    cat = kernel_prof.category(kernel)
    return {"GEMM (cuBLAS / CUTLASS)": PHASES[0], "attention (vLLM)": PHASES[1],
            "tree kernels (ours)": PHASES[2], "norm": PHASES[3], "activation": PHASES[3],
            "rotary": PHASES[3]}.get(cat, PHASES[4])


def step_phases(folder: Path) -> dict:
    """{(config, n): {phase: ms per decode step}} from kernels_<config>_N<n>.json."""
    out = {}
    for f in sorted(folder.glob("kernels_*_N*.json")):
        m = _NAME.search(f.name)
        if not m:
            continue
        ms = dict.fromkeys(PHASES, 0.0)
        for k, (_, us) in json.loads(f.read_text())["kernels"].items():
            ms[phase(k)] += us / 1e3
        out[(m.group(1), int(m.group(2)))] = ms
    return out


def throughput(folders: list, chain: str = "chain15async") -> dict:
    """{profile: {config: {n: median over rounds of tokens/s / the chain's}}}: each
    folder (one call) against its own chain in the same round; a config in several
    folders keeps the first folder's."""
    out: dict = {}
    for folder in folders:
        for (cell, n), cfgs in e2e_logs.read(Path(folder)).items():
            base = cfgs.get(chain)
            if cell == "step" or not base:
                continue
            for cfg, rounds in cfgs.items():
                rs = e2e_logs.ratios(rounds, base)
                if cfg != chain and rs:
                    out.setdefault(cell, {}).setdefault(cfg, {}).setdefault(
                        n, statistics.median(rs))
    return out


def draw(phases: dict, tput: dict, out: Path, tag: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    if phases:
        keys = sorted(phases, key=lambda k: (k[1], k[0]))
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(keys), 4.5))
        bottom = [0.0] * len(keys)
        for p in PHASES:
            vals = [phases[k][p] for k in keys]
            ax.bar(range(len(keys)), vals, bottom=bottom, label=p)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, total in enumerate(bottom):
            ax.text(i, total, f"{total:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{c}\n{n} req" for c, n in keys], fontsize=7)
        ax.set_ylabel("kernel time per decode step, ms")
        ax.set_title(f"decode step by kernel ({tag})")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        written.append(out / f"step_phases_{tag}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if tput:
        profiles = sorted(tput)
        fig, axes = plt.subplots(1, len(profiles), figsize=(3.6 * len(profiles), 3.6),
                                 squeeze=False)
        for ax, prof in zip(axes[0], profiles):
            for cfg, by_n in sorted(tput[prof].items()):
                ns = sorted(by_n)
                ax.plot(ns, [by_n[n] for n in ns], marker="o", label=cfg)
            ax.set_title(prof)
            ax.set_xlabel("requests")
            ax.set_xticks(sorted({n for v in tput[prof].values() for n in v}))
            ax.axhline(1.0, color="gray", lw=1, ls="--")
        axes[0][0].set_ylabel("tokens/s / the DFlash chain's (median of rounds)")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"end to end by batch size ({tag})")
        fig.tight_layout()
        written.append(out / f"e2e_by_batch_{tag}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kprof", type=Path, default=None)
    ap.add_argument("--e2e", type=Path, nargs="*", default=[])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tag", default="run")
    args = ap.parse_args(argv)
    phases = step_phases(args.kprof) if args.kprof else {}
    tput = throughput(args.e2e)
    if not phases and not tput:
        print("plot_phases: no kernels_*_N*.json and no e2e logs found", file=sys.stderr)
        return 2
    try:
        written = draw(phases, tput, args.out, args.tag)
    except ImportError:
        print("plot_phases: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    for w in written:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
