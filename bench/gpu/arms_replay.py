"""The tree-vs-chain choice's estimates against what each arm realized, from the step
traces step_bench.py saves per end-to-end cell (``arms_trace``: sched/arms.py's
``ArmLookup.trace``, one row per measured step: batch size, drafts, tree arm or not, ms,
tokens, the expected tokens per request-step of the tree and of the chain published
then).

    python bench/gpu/arms_replay.py STEP_BENCH_JSON [...]

Per config, cell, batch size and arm: the steps it played, the tokens per request-step
it realized, the mean estimate published over those steps, their ratio (estimate /
realized: > 1 overestimates) and ms per step: whether an arm's estimate matches what
that arm delivered when it played (an arm played a few steps realizes a noisy mean).
"""

from __future__ import annotations

import json
import statistics
import sys


def replay(trace) -> dict:
    """{(batch size, drafts): {"steps", "realized", "expected", "ratio", "ms"}} from one
    cell's trace: per arm, the tokens per request-step it realized on its own steps and
    the mean of its estimate published over those steps (steps before any estimate
    count in "steps" and "realized" only)."""
    out: dict = {}
    for n, k, tree, ms, tokens, e_tree, e_chain in trace:
        r = out.setdefault((n, k), {"steps": 0, "tok": 0.0, "est": [], "ms": []})
        r["steps"] += 1
        r["tok"] += tokens / n
        r["ms"].append(ms)
        est = e_tree if tree else e_chain
        if est is not None:
            r["est"].append(est)
    res = {}
    for key, r in out.items():
        realized = r["tok"] / r["steps"]
        expected = statistics.fmean(r["est"]) if r["est"] else None
        res[key] = {"steps": r["steps"], "realized": round(realized, 4),
                    "expected": None if expected is None else round(expected, 4),
                    "ratio": None if expected is None or not realized
                    else round(expected / realized, 4),
                    "ms": round(statistics.median(r["ms"]), 4)}
    return res


def table(docs) -> str:
    lines = ["| config | cell | requests | drafts | steps | realized | expected | "
             "expected / realized | ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for doc in docs:
        for cfg, v in doc.items():
            for cell, e in (v.get("e2e") or {}).items():
                trace = e.get("arms_trace")
                if not trace:
                    continue
                for (n, k), r in sorted(replay(trace).items()):
                    lines.append(f"| {cfg} | {cell} | {n} | {k} | {r['steps']} | "
                                 f"{r['realized']:.3f} | "
                                 f"{'-' if r['expected'] is None else r['expected']} | "
                                 f"{'-' if r['ratio'] is None else r['ratio']} | {r['ms']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    docs = []
    for p in paths:
        try:
            docs.append(json.load(open(p)))
        except (OSError, ValueError) as e:
            print(f"arms_replay: cannot read {p}: {e}", file=sys.stderr)
            return 2
    out = table(docs)
    if out.count("\n") < 2:
        print("arms_replay: no arms_trace in these files (step_bench.py records it since "
              "the trace was added; earlier runs have none)", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
