"""Ratios to the chain per cell and round, read from gdn_device.sh's e2e logs.

    python bench/gpu/e2e_logs.py DIR [--chain chain15async] [--fixed CONFIG] [--estimates]

DIR holds e2e_r<round>_<config>.txt (one fresh process per config and round).  The
device returns at most 8 files a call, so a call's step_bench.json files may stay
behind; its logs carry the same numbers (one line per cell: tokens/s, and the step
bench's "N <n> step ms").  Prints, per cell, each config's median ratio to the chain
(min-max over the rounds that ran both) and, with --fixed, the other configs' ratio to
that config in the same round (the choice against the fixed tree).  --estimates: per
config with the choice (its cells log sched/arms.py's summary), the tree arm's last
estimate / what it realized on its own steps, and the chain arm's (paired) estimate /
the chain config's tau in the same cell and round: whether the choice's numbers
predict what each arm delivers.  --decode: tokens/s of the decode steps alone (the
cell's step timeline without its first step, the prompt's prefill: run 24 saw that
step take 21-111 ms in every config, a cell of 256 tokens 0.3-0.9 s long).  --stalls:
per config, the decode steps over twice their cell's median step (host stalls: run 24
had 20-35 ms ones in every config) and the garbage collector's time in the timed run
(logged from run 25 on).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

_FILE = re.compile(r"e2e_r(\d+)_(.+)\.txt$")
_E2E = re.compile(r"\S+ (\S+) e2e (\S+) N (\d+) (\{.*)")
_STEP = re.compile(r"\S+ (\S+) N (\d+) step ms (\S+)")


def lines(folder: Path):
    """(round, config, line) for each line of the e2e_r<round>_<config>.txt files."""
    for f in sorted(folder.glob("e2e_r*_*.txt")):
        m = _FILE.search(f.name)
        if m:
            for line in f.read_text(errors="replace").splitlines():
                yield int(m.group(1)), m.group(2), line


def decode_rate(doc: dict) -> float | None:
    """Tokens/s over the decode steps: (tokens - the prefill's one a request) / the
    timeline's seconds after its first step (the prefill: no drafts); None where the
    timeline does not start with the prefill or misses a step's time."""
    tl = doc.get("timeline") or []  # [requests, rows, drafts (None: prefill), ms]
    if len(tl) < 3 or tl[0][2] is not None or any(t[3] is None for t in tl[1:-1]):
        return None
    n = doc.get("tokens", 0) - tl[0][0]  # the prefill step's token per request
    known = [t[3] for t in tl[1:-1]]
    # the last step has no next output to time it: the median of the others
    ms = sum(known) + (tl[-1][3] if tl[-1][3] is not None else statistics.median(known))
    return n / ms * 1e3 if ms > 0 else None


def read(folder: Path, decode: bool = False) -> dict:
    """{(cell, n): {config: {round: value}}}; cell "step" holds ms, others tokens/s
    (decode: of the decode steps alone, cells whose timeline lacks steps left out)."""
    out: dict = {}
    for rnd, cfg, line in lines(folder):
        e = _E2E.match(line)
        if e and e.group(1) == cfg:
            doc = json.loads(e.group(4))
            v = decode_rate(doc) if decode else doc["tok_per_s"]
            if v is None:
                continue
            out.setdefault((e.group(2), int(e.group(3))), {}).setdefault(cfg, {})[rnd] = v
            continue
        s = _STEP.match(line)
        if s and s.group(1) == cfg:
            out.setdefault(("step", int(s.group(2))), {}).setdefault(cfg, {})[rnd] = \
                float(s.group(3))
    return out


def cell_docs(folder: Path) -> dict:
    """{(config, round): {(cell, n): the cell's JSON}} from the e2e lines."""
    out: dict = {}
    for rnd, cfg, line in lines(folder):
        e = _E2E.match(line)
        if e and e.group(1) == cfg:
            out.setdefault((cfg, rnd), {})[(e.group(2), int(e.group(3)))] = \
                json.loads(e.group(4))
    return out


def estimates(folder: Path, chain: str) -> dict:
    """{(config, cell, n): {"tree": [est / realized per round], "chain": [paired est /
    the chain config's tau per round], "steps": tree steps}} where the arms' summary
    has both arms at the cell's batch size."""
    docs = cell_docs(folder)
    out: dict = {}
    for (cfg, rnd), cells in sorted(docs.items()):
        base = docs.get((chain, rnd), {})
        for (cell, n), doc in sorted(cells.items()):
            arms = (doc.get("arms") or {}).get(str(n))
            if not arms:
                continue
            tree = next((v for k, v in arms.items() if k.startswith("tree ")), None)
            ch = next((v for k, v in arms.items() if k.startswith("chain ")), None)
            if tree is None or ch is None:
                continue
            r = out.setdefault((cfg, cell, n), {"tree": [], "chain": [], "steps": []})
            if tree.get("expected") and tree.get("measured"):
                r["tree"].append(tree["expected"] / tree["measured"])
                r["steps"].append(tree.get("steps", 0))
            tau = base.get((cell, n), {}).get("tau")
            if ch.get("expected") and tau:
                r["chain"].append(ch["expected"] / tau)
    return out


def stalls(folder: Path) -> dict:
    """{config: {"cells", "steps", "stalls", "stall_ms", "gc_ms", "gc2"}} summed over
    cells and rounds: decode steps over 2x their cell's median, the ms they took beyond
    that median, and the collector's ms / generation-2 collections (cells that log it)."""
    out: dict = {}
    for (cfg, _rnd), cells in sorted(cell_docs(folder).items()):
        r = out.setdefault(cfg, {"cells": 0, "steps": 0, "stalls": 0, "stall_ms": 0.0,
                                 "gc_ms": None, "gc2": None})
        for doc in cells.values():
            ms = [t[3] for t in (doc.get("timeline") or [])[1:] if t[3] is not None]
            if len(ms) < 3:
                continue
            med = statistics.median(ms)
            big = [m for m in ms if m > 2 * med]
            r["cells"] += 1
            r["steps"] += len(ms)
            r["stalls"] += len(big)
            r["stall_ms"] += sum(m - med for m in big)
            g = doc.get("gc")
            if g:
                r["gc_ms"] = (r["gc_ms"] or 0.0) + sum(g["ms"])
                r["gc2"] = (r["gc2"] or 0) + g["count"][2]
    return out


def stalls_table(st: dict) -> str:
    lines = ["| config | cells | decode steps | steps > 2x the cell median | their ms beyond "
             "it | GC ms (gen-2 collections) |", "|---|---:|---:|---:|---:|---|"]
    for cfg, r in sorted(st.items()):
        gc_ = "-" if r["gc_ms"] is None else f"{r['gc_ms']:.1f} ({r['gc2']})"
        lines.append(f"| {cfg} | {r['cells']} | {r['steps']} | {r['stalls']} | "
                     f"{r['stall_ms']:.1f} | {gc_} |")
    return "\n".join(lines)


def estimates_table(est: dict, chain: str) -> str:
    lines = ["| config | cell | tree: estimate / realized (its steps) | chain: paired "
             f"estimate / {chain}'s tau |", "|---|---|---|---|"]
    for (cfg, cell, n), r in sorted(est.items()):
        steps = f"; {statistics.median(r['steps']):.0f} steps" if r["steps"] else ""
        lines.append(f"| {cfg} | {cell} N {n} | {fmt(r['tree'])}{steps} | "
                     f"{fmt(r['chain'])} |")
    return "\n".join(lines)


def ratios(a: dict, b: dict) -> list[float]:
    """a[r] / b[r] over the rounds both ran."""
    return [a[r] / b[r] for r in sorted(a) if r in b and b[r]]


def fmt(rs: list[float]) -> str:
    if not rs:
        return "-"
    return f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f}, {len(rs)})"


def table(data: dict, chain: str, fixed: str | None) -> str:
    cfgs = sorted({c for v in data.values() for c in v if c != chain})
    head = ["cell", f"{chain} median"] + [f"{c} / chain" for c in cfgs]
    if fixed:
        head += [f"{c} / {fixed}" for c in cfgs if c != fixed]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in sorted(data, key=lambda k: (k[0] == "step", k)):
        row = data[cell]
        ch = row.get(chain, {})
        cells = [f"{cell[0]} N {cell[1]}",
                 f"{statistics.median(ch.values()):.2f}" if ch else "-"]
        cells += [fmt(ratios(row.get(c, {}), ch)) for c in cfgs]
        if fixed:
            cells += [fmt(ratios(row.get(c, {}), row.get(fixed, {})))
                      for c in cfgs if c != fixed]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--chain", default="chain15async")
    ap.add_argument("--fixed", default=None, help="a config to hold the others against")
    ap.add_argument("--estimates", action="store_true",
                    help="the choice's estimates against what each arm realized")
    ap.add_argument("--decode", action="store_true",
                    help="tokens/s of the decode steps alone (without the prefill step)")
    ap.add_argument("--stalls", action="store_true",
                    help="long decode steps and the garbage collector's time per config")
    args = ap.parse_args(argv)
    data = read(args.folder, args.decode)
    if not data:
        print(f"e2e_logs: no e2e_r<round>_<config>.txt lines in {args.folder}", file=sys.stderr)
        return 2
    if args.stalls:
        print(stalls_table(stalls(args.folder)))
        return 0
    if args.estimates:
        est = estimates(args.folder, args.chain)
        if not est:
            print(f"e2e_logs: no cell in {args.folder} logs the choice's arms", file=sys.stderr)
            return 2
        print(estimates_table(est, args.chain))
        print("ratios: median (min-max, rounds); > 1 overestimates")
        return 0
    print(table(data, args.chain, args.fixed))
    print("step rows: ms per step (ratio < 1 is faster); other rows: tokens/s "
          "(ratio > 1 is faster); (min-max, rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
