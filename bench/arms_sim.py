"""The tree-vs-chain choice (payload/arms.py + v2_arms.py), simulated on the CPU against
the real tree build and walk: tokens/s of the choice vs always the chain and vs the
faster arm (each on the same rows), for short and long runs, at measured step times.
Prints a table.

    python bench/arms_sim.py                      # runs 12 and 21's step times
    python bench/arms_sim.py --tree-ms 9 --chain-ms 7 --seeds 24
    python bench/arms_sim.py --tree-ms 30.3 --chain-ms 29.7 --budget 16
    python bench/arms_sim.py --tree-ms 35.36 --chain-ms 34.45 --budget 16 --requests 4
    python bench/arms_sim.py --min-rows 1      # the chain may lead from the first rows
    python bench/arms_sim.py --switch-ms 5     # a switch of arms costs 5 ms more
    python bench/arms_sim.py --z 2             # the chain leads only past 2 standard errors
    python bench/arms_sim.py --keep-times      # step times known from an earlier cell

Each profile is a calibrated synthetic drafter (the true token at a rank drawn from the
profile; tests/gpu/test_arms.py's _tree_step) with L = 15, C = 15 and the tree of
each row of STEP_MS (the 8B shape: DDTree's V2 default, B = 64 at 1 request, 32 at 2;
the 27B shape: B = 16 next to the chain of 15).  Cells of 35, 55 and 95 steps are the
GPU end-to-end cells' lengths at 256 tokens (p90, p80, p60).  A step of
the simulated engine verifies the arm the lookup chose one step earlier (async
scheduling), takes that arm's time (+-2 %) and emits its real accepted length; a tree
step feeds the worker half (both arms' counts) one row per request.  Speed here is
tokens per simulated ms: what it measures is the choice's cost (calibration,
exploration, wrong calls), not the GPU.
"""

import argparse
import random
from collections import deque
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gpu.test_arms import _tree_step, out  # noqa: E402
from gpu.conftest import payload_module  # noqa: E402

arms = payload_module("sched.arms")
v2_arms = payload_module("sched.paired")
channel = payload_module("sched.channel")
L, V, B, C = 15, 2000, 64, 15
PROFILES = {"p60": [0.6, 0.15, 0.08, 0.05], "p80": [0.8, 0.1, 0.04],
            "p90": [0.9, 0.05, 0.02], "weak": [0.3, 0.1]}
# ms per step (timeline medians), tree / chain of 15, the tree's budget, requests; V2,
# 0.33.0 (bench/RESULTS.md): 8B shape on the H200 (run 12), 27B shape on the H100
# (run 21, ddtree16autoasync's steady steps)
# (run 21, 4 requests: ddtree16async's and chain15async's steady steps, round 2: the arms
# at every batch size where B <= C + 1, step_bench's ddtree16every, #29)
# (realpair_h100_2: 8B shape on the H100, ddtree64autoasync's steady tree / chain steps)
# vLLM's async scheduling: the drafts of step j + 1 are set when step j is scheduled,
# after the output of step j - 2 (2 steps in flight between the last output seen and the
# step a choice sets; run 24: a cold cell's chain calibration of 2 windows, 8 steps)
IN_FLIGHT = 2
# the first decode steps after a prefill as the scheduler's clock saw them (run 24, 8B,
# H100: 4.1 / 5.2, 5.8 / 5.7, 4.3 / 5.2 at steps 1-2, 6.8 / 5.9 / 7.2 at steps 3-5,
# where a step took ~9.1-9.6 ms; the prefill's interval holds the rest): BACKLOG
# steps, from one of the first three, each seen at LOW-HIGH of its time
BACKLOG, BACKLOG_LOW, BACKLOG_HIGH = 3, 0.45, 0.8
# step_bench.py renews the choice, then runs an untimed request of 8 tokens (2-3 decode
# steps at these profiles), then the timed cell
WARMUP = 3
STEP_MS = {"8B, 1": (8.33, 6.98, 64, 1), "8B, 2": (8.5, 7.18, 32, 2),
           "8B H100, 1": (10.57, 9.13, 64, 1), "8B H100, 2": (10.9, 9.2, 32, 2),
           "27B, 1": (30.3, 29.7, 16, 1), "27B, 4": (35.36, 34.45, 16, 4),
           "8B H100 run 24, 1": (9.55, 8.86, 63, 1), "8B H100 run 24, 2": (9.91, 8.95, 63, 2)}


def play(pool, steps: int, seed: int, ms_tree: float, ms_chain: float, fixed=None,
         switch_ms: float = 0.0, reqs: int = 1, B: int = 64, keep: list | None = None,
         keep_times: bool = False, in_flight: int = IN_FLIGHT, backlog: bool = True,
         warmup: int = WARMUP):
    """(tokens per ms, share of tree steps) of the choice over ``steps`` steps of
    ``reqs`` requests, or of always the arm ``fixed`` (B or C) on the same rows and
    times; ``switch_ms`` is added to a step whose arm differs from the step before;
    ``keep`` gets the lookup (its trace: bench/gpu/arms_replay.py); keep_times: the
    choice first plays an earlier cell (other rows) and keeps only its step times
    (ArmLookup.renew(keep_times=True): a running server meeting new text).  in_flight:
    steps between the last one observed and the one a choice sets (vLLM's async
    scheduling: 2); backlog: the first steps of a cell are seen closer together than
    they ran (BACKLOG); warmup: decode steps of a short untimed request first, after the
    choice was renewed (step_bench.py's warm-up: the tree's calibration may be done
    before the timed cell starts)."""
    ch = channel.ArmChannel()  # one engine's: both halves in one process
    # the kernels' torch references (tests run under TRITON_INTERPRET: slow, and what is
    # simulated here is the choice; tests/gpu/test_paired_counts.py holds them equal)
    ex = v2_arms.ArmExpect([reqs], C, L, max_reqs=reqs, device="cpu", channel=ch,
                           fused=False)
    lookup = arms.ArmLookup([0] + [B] * reqs, C, ch)
    clock = [0.0]
    lookup.clock = lambda: clock[0] / 1000
    brng = random.Random(seed + 7)
    seen = [1.0] * brng.randrange(3) + [brng.uniform(BACKLOG_LOW, BACKLOG_HIGH)
                                        for _ in range(BACKLOG)]
    cell = (pool, ex, clock, ms_tree, ms_chain, fixed, switch_ms, reqs, B, in_flight,
            seen if backlog else ())
    if keep_times and not fixed:
        _cell(lookup, 40, random.Random(seed + 1000), *cell)
        lookup = lookup.renew(keep_times=True)
        ex.reset()
    if keep is not None:
        keep.append(lookup)
    if warmup and not fixed:
        _cell(lookup, warmup, random.Random(seed + 2000), *cell)
    tokens, ms, trees = _cell(lookup, steps, random.Random(seed), *cell)
    return tokens / ms, trees / steps


def _cell(lookup, steps, rng, pool, ex, clock, ms_tree, ms_chain, fixed, switch_ms, reqs, B,
          in_flight=1, backlog=()):
    """``steps`` steps of the choice (or of ``fixed``) on random rows of the pool:
    (tokens, ms, tree steps).  Each cell starts with a prefill (not a decode step: the
    choice measures from the next one)."""
    vals, idx, lse, walk, hits = pool
    tree_acc, chain_acc = walk.num_accepted, hits[:, :C].sum(1)
    slots, valid = torch.arange(reqs), torch.ones(reqs, dtype=torch.bool)
    names = [f"r{i}" for i in range(reqs)]
    clock[0] += 20.0
    lookup.observe(*out({r: 16 for r in names}, {}, [1] * reqs))  # the prefill
    pending = deque(lookup[reqs] for _ in range(in_flight))
    k, tokens, ms, trees = pending[0], 0, 0.0, 0
    prev = k
    for step in range(steps):
        j = torch.tensor([rng.randrange(tree_acc.numel()) for _ in range(reqs)])
        pending.append(lookup[reqs])  # set now, verified in_flight steps later
        k = pending.popleft()
        k = fixed or k
        if k == B:
            ex.draft(vals[j], idx[j], lse[j], slots)
            ex.verified(reqs, slots, walk.output_tokens[j], tree_acc[j], valid)
            emitted, dt, trees = (1 + tree_acc[j]).tolist(), ms_tree, trees + 1
        else:
            emitted, dt = (1 + chain_acc[j]).tolist(), ms_chain
        dt = dt * rng.uniform(0.98, 1.02) + (switch_ms if k != prev else 0.0)
        prev = k
        # the clock the choice reads: the backlog's first steps seen closer together
        clock[0] += dt * (backlog[step] if step < len(backlog) else 1.0)
        tokens, ms = tokens + sum(emitted), ms + dt
        lookup.observe(*out({r: 1 + k for r in names}, {r: k for r in names}, emitted))
    return tokens, ms, trees


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree-ms", type=float)
    ap.add_argument("--chain-ms", type=float)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--steps", default="35,55,95,400")
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="added to a step whose arm differs from the step before's")
    ap.add_argument("--budget", type=int, default=B,
                    help="the tree's budget with --tree-ms / --chain-ms (default 64)")
    ap.add_argument("--requests", type=int, default=1,
                    help="requests per step with --tree-ms / --chain-ms")
    ap.add_argument("--z", type=float, default=arms.Z,
                    help="the chain leads where it leads by this many standard errors")
    ap.add_argument("--min-rows", type=int, default=arms.MIN_ROWS,
                    help="and only once this many paired rows are in")
    ap.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                    help="steps between the last output seen and the step a choice sets "
                         "(vLLM's async scheduling: 2; the older simulation: 1)")
    ap.add_argument("--no-backlog", action="store_true",
                    help="the first steps of a cell seen as long as they ran")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help="decode steps of an untimed request before each cell")
    ap.add_argument("--keep-times", action="store_true",
                    help="the choice keeps the step times of an earlier cell (a running "
                         "server); its counts start afresh")
    a = ap.parse_args()
    arms.Z, arms.MIN_ROWS = a.z, a.min_rows
    times = {"given": (a.tree_ms, a.chain_ms, a.budget, a.requests)} if a.tree_ms and a.chain_ms \
        else STEP_MS
    lens = [int(x) for x in a.steps.split(",")]
    pools = {(b, p): _tree_step(3, 1500, L, V, b, probs)
             for b in sorted({t[2] for t in times.values()}) for p, probs in PROFILES.items()}
    print(f"Z = {arms.Z}, MIN_ROWS = {arms.MIN_ROWS}, {a.seeds} seeds")
    print("| shape, requests | B | ms tree / chain | profile | tree / chain (always) | "
          + " | ".join(f"{s} steps: / chain, / faster, tree share" for s in lens) + " |")
    print("| --- | ---: | --- | --- | ---: |" + " ---: |" * len(lens))
    for n, (mt, mc, b, r) in times.items():
        for p in PROFILES:
            pool = pools[(b, p)]
            walk, hits = pool[3], pool[4]
            rate_t = (1 + float(walk.num_accepted.float().mean())) / mt
            rate_c = (1 + float(hits[:, :C].sum(1).float().mean())) / mc
            cells = []
            for s in lens:  # each seed: the same rows for the choice and both arms
                got, chain, best, share = [], [], [], []
                for seed in range(a.seeds):
                    g, sh = play(pool, s, seed, mt, mc, switch_ms=a.switch_ms, reqs=r, B=b,
                                 keep_times=a.keep_times, in_flight=a.in_flight,
                                 backlog=not a.no_backlog, warmup=a.warmup)
                    c = play(pool, s, seed, mt, mc, fixed=C, reqs=r, B=b)[0]
                    t = play(pool, s, seed, mt, mc, fixed=b, reqs=r, B=b)[0]
                    got.append(g), chain.append(c), best.append(max(c, t)), share.append(sh)
                m = statistics.mean
                cells.append(f"{m(got) / m(chain):.3f}, {m(got) / m(best):.3f}, "
                             f"{m(share):.2f}")
            print(f"| {n} | {b} | {mt} / {mc} | {p} | {rate_t / rate_c:.3f} | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
