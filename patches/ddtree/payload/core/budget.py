"""Cost-aware tree budget: per step, the budget (or the drafter's top-1 chain) that
maximises expected tokens per second.  Pure torch/Python, no engine import.

Model.  A step verifies N requests; with budget b each request emits 1 + A_b tokens
(A_b accepted drafts, then the bonus token) and the step costs C(N, q) ms, q = b + 1
query tokens per request, from a measured ``CostTable``.  The choice is

    argmax over candidates c of  (N + sum_r E[A_c(r)]) / C(N, c)

with ties to the cheaper candidate.  Candidates: the allowed budgets (the
CUDA-graph-captured sizes <= num_speculative_tokens) and the chain (L nodes, the
DFlash drafts, costed as the chain).  One budget per batch: every request then has the
same query length, so the step stays a uniform batch that replays one captured graph;
per-request budgets would make batches non-uniform (no FULL graph) for a gain that
only exists when requests differ a lot in confidence.

Expected acceptance.  The tree build pops nodes in non-increasing score order, so
under the drafter's own factorised distribution Q,
    E_Q[A | budget b] = sum over the first b nodes of exp(score)
(DDTree's E_Q[accepted] = sum of q(u) over tree nodes, and a budget-b tree is the
first b nodes of the budget-B tree).  Split by depth, sum_{nodes at depth d} exp(score)
= Q(A >= d): the paths to depth d are disjoint events.  The drafter is not the target,
so each depth gets a factor c_d, calibrated online as a ratio of decayed sums:

    c_d = (prior + sum_steps observed[A >= d]) / (prior + sum_steps Q(A >= d))

(observed: how many verified requests accepted >= d nodes; both sums decay by
``decay`` per observed step).  E[A_b] = sum_d c_d Q_b(A >= d).  With no observation
c_d = 1 (the drafter's own probabilities); ``prior`` pseudo-counts keep early
estimates near 1.

Interfaces.  ``BudgetController.choose(tree, chain_scores)`` -> ``Choice`` (one host
read of a few floats); ``observe(...)`` after the walk (device ops only);
``counts`` = histogram of the choices (metrics).
"""

from __future__ import annotations

import bisect
import json
import os
import sys
from dataclasses import dataclass

import torch

# Step ms on one H200 (vLLM 0.20.2, Qwen3-8B shape, dummy weights, bf16, FULL CUDA
# graphs, prompt 512; bench/RESULTS.md 'GPU engine' run 3, medians; single-kernel tree
# attention).  tree: {N: {q: ms}} with q = B + 1; chain: {N: ms} for DFlash k = 15.
H200_VLLM_0_20_2 = {
    "gpu": "H200",
    "source": "bench/RESULTS.md GPU engine run 3 (vLLM 0.20.2, single-kernel tree attention)",
    "tree": {
        1: {17: 10.02, 33: 9.90, 65: 10.35, 129: 12.70, 257: 15.17},
        4: {17: 11.35, 33: 12.20, 65: 16.34, 129: 24.69, 257: 39.45},
        16: {17: 18.73, 33: 24.87, 65: 41.05, 129: 72.19, 257: 135.65},
        32: {17: 28.39, 33: 44.66, 65: 76.42, 129: 137.37, 257: 267.40},
    },
    "chain": {1: 9.03, 4: 9.47, 16: 13.19, 32: 20.78},
}
TABLES = {"H200": H200_VLLM_0_20_2}

CONTROL_MODES = ("off", "auto")


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), linear extrapolation past both ends."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class CostTable:
    """Verify-step time (ms) by batch size N and query tokens per request q.

    tree: {N: {q: ms}} on a full grid (the same q for every N); chain: {N: ms} (optional:
    without it the chain costs a tree of the same q).  Along q the table is made
    non-decreasing (a bigger tree is never cheaper: noise between runs is not a
    reason to grow the tree); lookups interpolate linearly in q then in N and
    extrapolate linearly past the grid (never below 1 % of the smallest entry).
    """

    def __init__(self, tree: dict, chain: dict | None = None, name: str = ""):
        self.name = name
        self.ns = sorted(int(n) for n in tree)
        if not self.ns:
            raise ValueError("cost table: no rows")
        self.qs = sorted(int(q) for q, _ in _items(tree, self.ns[0]))
        grid = []
        for n in self.ns:
            row = {int(q): float(ms) for q, ms in _items(tree, n)}
            if sorted(row) != self.qs:
                raise ValueError(f"cost table: batch {n} has query sizes {sorted(row)}, "
                                 f"expected {self.qs} (a full grid)")
            ms = [row[q] for q in self.qs]
            for j in range(1, len(ms)):
                ms[j] = max(ms[j], ms[j - 1])
            grid.append(ms)
        self.grid = grid
        self.chain = {int(n): float(ms) for n, ms in (chain or {}).items()}
        self.floor = 0.01 * min(min(r) for r in grid)

    @classmethod
    def load(cls, src) -> "CostTable":
        """From a dict like H200_VLLM_0_20_2 or a JSON file with the same keys."""
        if isinstance(src, (str, os.PathLike)):
            with open(src) as f:
                src = json.load(f)
        return cls(src["tree"], src.get("chain"), src.get("source", src.get("gpu", "")))

    @classmethod
    def for_device(cls, device_name: str, path=None) -> "CostTable":
        """The table in ``path`` (a JSON file: ddtree_cost_table) or the shipped table
        for this GPU."""
        if path:
            return cls.load(path)
        for key, table in TABLES.items():
            if key.lower() in device_name.lower():
                return cls.load(table)
        raise ValueError(
            f"ddtree_budget_control='auto' needs a step-cost table for {device_name!r} "
            f"(shipped: {', '.join(TABLES)}): measure one (bench/gpu/step_bench.py) and "
            "point ddtree_cost_table at it, or set ddtree_budget_control='off'")

    @staticmethod
    def from_step_bench(*results, gpu: str = "", source: str = "") -> dict:
        """A table (the dict form ``load`` takes) from bench/gpu/step_bench.py results
        ({config: {"steps": {N: {"step_ms": ...}}}}; configs ``ddtree<B>`` and
        ``chain<k>``); the batch sizes every ddtree config measured form the grid."""
        tree, chain = {}, {}
        for res in results:
            if isinstance(res, (str, os.PathLike)):
                with open(res) as f:
                    res = json.load(f)
            for name, r in res.items():
                steps = {int(n): v["step_ms"] for n, v in (r.get("steps") or {}).items()
                         if v.get("step_ms")}
                if name.startswith("ddtree") and name[6:].isdigit():
                    for n, ms in steps.items():
                        tree.setdefault(n, {})[int(name[6:]) + 1] = ms
                elif name.startswith("chain") and name[5:].isdigit():
                    chain.update(steps)
        qs = set().union(*tree.values()) if tree else set()
        full = {n: {q: r[q] for q in sorted(qs)} for n, r in sorted(tree.items()) if set(r) == qs}
        return {"gpu": gpu, "source": source, "tree": full, "chain": dict(sorted(chain.items()))}

    def tree_ms(self, n: int, q: int) -> float:
        per_n = [_interp(self.qs, row, q) for row in self.grid]
        return max(self.floor, _interp(self.ns, per_n, n))

    def chain_ms(self, n: int, q: int) -> float:
        if not self.chain:
            return self.tree_ms(n, q)
        ns = sorted(self.chain)
        return max(self.floor, _interp(ns, [self.chain[k] for k in ns], n))


def _items(tree, n):
    row = tree[n] if n in tree else tree[str(n)]
    return row.items()


@dataclass(frozen=True)
class Choice:
    budget: int  # draft nodes per request this step
    chain: bool  # the top-1 chain instead of the tree
    expected_tokens: float  # per step, all requests, bonus tokens included
    cost_ms: float

    @property
    def label(self) -> str:
        return "chain" if self.chain else str(self.budget)


def default_budgets(max_budget: int, captured=(16, 32, 64, 128, 256, 512)) -> list[int]:
    """The allowed tree sizes: the captured sizes below max_budget, and max_budget."""
    return sorted({b for b in captured if b < max_budget} | {max_budget})


def expected_by_depth(scores: torch.Tensor, depths: torch.Tensor, num_nodes, depth: int):
    """[N, depth + 1]: Q(A >= d) per request from the first num_nodes nodes (column 0
    unused): sum of exp(score) over nodes at depth d.  num_nodes: int or [N]."""
    n, w = scores.shape
    j = torch.arange(w, device=scores.device).unsqueeze(0)
    used = j < (num_nodes.reshape(-1, 1) if isinstance(num_nodes, torch.Tensor) else num_nodes)
    p = torch.where(used, torch.exp(scores.float()), 0.0)
    out = torch.zeros(n, depth + 1, dtype=torch.float32, device=scores.device)
    return out.scatter_add_(1, depths.long().clamp(0, depth), p)


class BudgetController:
    """Chooses the step's budget; calibrates the drafter's probabilities online.

    max_budget: B (num_speculative_tokens, the built tree's size); depth: L;
    cost: CostTable; budgets: allowed tree sizes (default: ``default_budgets``);
    chain: whether the top-1 chain is a candidate; decay / prior: calibration.
    """

    def __init__(self, cost: CostTable, max_budget: int, depth: int, budgets=None,
                 chain: bool = True, decay: float = 0.98, prior: float = 1.0, device="cpu"):
        self.cost = cost
        self.max_budget = max_budget
        self.depth = depth
        self.budgets = sorted(set(budgets or default_budgets(max_budget)))
        if not self.budgets or self.budgets[0] < 1 or self.budgets[-1] > max_budget:
            raise ValueError(f"budgets must lie in 1..{max_budget}, got {self.budgets}")
        self.use_chain = chain
        self.decay = decay
        self.prior = prior
        self.num = torch.zeros(depth + 1, dtype=torch.float64, device=device)
        self.den = torch.zeros(depth + 1, dtype=torch.float64, device=device)
        self._no_pad = torch.ones(depth + 1, dtype=torch.float64, device=device)
        self._no_pad[0] = 0.0  # (once: a host scalar written into a CUDA tensor syncs)
        self.counts: dict[str, int] = {}
        self.last: Choice | None = None
        self._idx = None

    # ------------------------------------------------------------------ calibration
    def calibration(self) -> torch.Tensor:
        """c_d [depth + 1] (c_0 = 0 for pad nodes), clamped to [0.01, 10]."""
        c = ((self.num + self.prior) / (self.den + self.prior)).clamp(0.01, 10.0)
        return (c * self._no_pad).float()

    def observe(self, scores, depths, num_nodes, num_accepted, valid=None) -> None:
        """After the walk: scores/depths [M, W] of the verified trees (pop order),
        num_nodes [M] nodes verified per request, num_accepted [M] accepted drafts
        (bonus excluded); valid [M] bool masks out rows without a tree.  Device ops
        only (no host sync)."""
        dev = self.num.device
        scores, depths = scores.to(dev), depths.to(dev)
        pred = expected_by_depth(scores, depths, num_nodes.to(dev), self.depth)
        d = torch.arange(self.depth + 1, device=dev)
        obs = (num_accepted.to(dev).reshape(-1, 1) >= d).to(torch.float64)
        if valid is not None:
            keep = valid.to(dev).reshape(-1, 1)
            pred = torch.where(keep, pred, 0.0)
            obs = torch.where(keep, obs, 0.0)
        self.num.mul_(self.decay).add_(obs.sum(0))
        self.den.mul_(self.decay).add_(pred.sum(0).double())

    def observe_rows(self, tree, rows, num_nodes, num_accepted) -> None:
        """observe() for a runtime that knows, per verified request, its row in the
        proposer's last tree (rows [M], -1 = no tree) and how many nodes it verified."""
        ok = rows >= 0
        r = rows.clamp(min=0)
        self.observe(tree.scores[r], tree.depths[r], torch.where(ok, num_nodes, 0),
                     num_accepted, ok)

    # ------------------------------------------------------------------ choice
    def expected(self, scores, depths, chain_scores=None) -> list[float]:
        """Calibrated E[accepted], summed over requests, for every candidate: the
        allowed budgets in order, then the chain (if a candidate).  One host read."""
        c = self.calibration().to(scores.device)
        w = c[depths.long().clamp(0, self.depth)] * torch.exp(scores.float())
        cum = w.cumsum(1).sum(0)  # [W]: sum over requests of the first-b prefix sums
        parts = [cum[self._index(cum.shape[0], cum.device)]]
        if self.use_chain and chain_scores is not None:
            lc = min(chain_scores.shape[1], self.max_budget)
            cd = c[1: lc + 1].to(chain_scores.device)
            parts.append((torch.exp(chain_scores[:, :lc].float()) * cd).sum().reshape(1))
        return torch.cat(parts).tolist()

    def _index(self, width: int, device) -> torch.Tensor:
        key = (width, str(device))
        if self._idx is None or self._idx[0] != key:  # cached: no host-to-device copy per step
            b = [min(b, width) - 1 for b in self.budgets]
            self._idx = (key, torch.tensor(b, device=device))
        return self._idx[1]

    def choose(self, tree, chain_scores=None, n: int | None = None) -> Choice:
        """The step's candidate for a tree batch (DDTree of max_budget nodes, pop
        order) and, for the chain candidate, chain_scores [N, L] (tree_build.chain_scores).
        n: requests in the verify batch (default: the tree's rows)."""
        n = tree.scores.shape[0] if n is None else n
        exp = self.expected(tree.scores, tree.depths, chain_scores)
        cands = [(self.cost.tree_ms(n, b + 1), b, False, e) for b, e in zip(self.budgets, exp)]
        if len(exp) > len(self.budgets):
            lc = min(chain_scores.shape[1], self.max_budget)
            cands.append((self.cost.chain_ms(n, lc + 1), lc, True, exp[-1]))
        best = None
        for ms, b, is_chain, e in sorted(cands, key=lambda x: (x[0], x[1], not x[2])):
            rate = (n + e) / ms
            if best is None or rate > best[0]:
                best = (rate, Choice(b, is_chain, n + e, ms))
        choice = best[1]
        self.counts[choice.label] = self.counts.get(choice.label, 0) + 1
        self.last = choice
        return choice

    def metrics(self) -> dict:
        return {"budget_choices": dict(self.counts),
                "calibration": [round(x, 4) for x in self.calibration().tolist()[1:]]}


def build_controlled(draft, controller: BudgetController, logprobs: bool = False, builder=None):
    """The proposer's step under the controller: the budget-B tree (one vocab pass;
    ``builder``: a graphed.GraphedBuild to replay it from a CUDA graph), the choice, and
    (if chosen) the chain.  Returns (tree to verify, its draft tokens [N, budget],
    Choice); the tree keeps B columns (its first ``budget`` nodes are the budget tree),
    so the runtime's buffers keep their shape."""
    from .graphed import build_step
    from .tree_build import build_chain_from_topk

    b = controller.max_budget
    if builder is None:
        step = build_step(draft, b, logprobs, with_chain=controller.use_chain)
    else:
        step = builder(draft)
    choice = controller.choose(step.tree, step.chain_scores)
    tree = step.tree
    if choice.chain:
        tree = build_chain_from_topk(step.vals, step.idx, b, step.lse)
    return tree, tree.tokens[:, : choice.budget], choice


def batch_schedule(cost: CostTable, tau: dict, max_batch: int, chain_tau: float | None = None,
                   chain_k: int = 15) -> dict:
    """A budget per batch size for vLLM's ``num_speculative_tokens_per_batch_size``.

    tau: {budget: tokens a request emits per step with that budget} (accepted + bonus,
    e.g. 1 + accepted / trees from a VLLM_DDTREE_STATS_FILE run); per batch size N the
    budget maximising tau[b] / tree_ms(N, b + 1) wins (ties: the smaller budget).  With
    chain_tau (the DFlash chain's tokens per step at k = chain_k) the chain competes too:
    where the best tree's expected tokens/s is below the chain's, that batch size gets
    chain steps (budget chain_k with ``ddtree_chain_budget`` = chain_k on the V2 runner,
    which cost what the chain costs); tree budgets <= chain_k are then not candidates
    (they would run as chains).  Returns {"schedule": [[first N, last N, budget], ...],
    "ddtree_chain_budget": chain_k or None, "rows": [{"n", "budget", "ms", "vs_chain",
    "chain"}, ...], "speculative_config": the keys to set} (vs_chain: the best
    tree's tokens/s over the chain's; ddtree_chain_budget 0 there: no chain steps, and
    not DDTree's V2 default).
    """
    tau = {int(b): float(t) for b, t in tau.items()}
    if not tau or any(b < 1 or t <= 0 for b, t in tau.items()):
        raise ValueError(f"tau must map budgets >= 1 to tokens per step > 0, got {tau}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if chain_tau:
        tau = {b: t for b, t in tau.items() if b > chain_k}
        if not tau:
            raise ValueError(f"with a chain of {chain_k}, tree budgets must exceed it")
    rows, sched, chained = [], [], False
    for n in range(1, max_batch + 1):
        # ms per emitted token, smallest wins (ties: the smaller budget)
        _, b = min((cost.tree_ms(n, b + 1) / t, b) for b, t in tau.items())
        row = {"n": n, "budget": b, "ms": round(cost.tree_ms(n, b + 1), 4), "chain": False}
        if chain_tau:
            chain_ms = cost.chain_ms(n, chain_k + 1)
            row["vs_chain"] = round(tau[b] / row["ms"] / (chain_tau / chain_ms), 4)
            if row["vs_chain"] < 1:
                row.update(budget=chain_k, ms=round(chain_ms, 4), chain=True)
                chained = True
        rows.append(row)
        b = row["budget"]
        if sched and sched[-1][2] == b:
            sched[-1][1] = n
        else:
            sched.append([n, n, b])
    chain_budget = chain_k if chained else 0
    # the keys to put into speculative_config (method "ddtree", model: your drafter)
    config = {"num_speculative_tokens": max(tau), "num_speculative_tokens_per_batch_size":
              sched, "ddtree_chain_budget": chain_budget}
    return {"schedule": sched, "ddtree_chain_budget": chain_budget or None,
            "speculative_config": config, "rows": rows}


def control_mode(spec) -> str:
    """SpeculativeConfig.ddtree_budget_control ('off' when the field is absent)."""
    mode = getattr(spec, "ddtree_budget_control", None) or "off"
    if mode not in CONTROL_MODES:
        raise ValueError(f"ddtree_budget_control must be 'off' or 'auto', got {mode!r}")
    return mode


def main(argv: list[str]) -> int:
    """python -m ddtree_patcher.patches.ddtree.payload.core.budget STEP_BENCH.json ...   -> a cost table
    python -m ddtree_patcher.patches.ddtree.payload.core.budget schedule STEP_BENCH.json --tau 16=4.7,64=6.0
        [--chain-tau 4.5] [--max-batch 64]                         -> a budget schedule
    (JSON on stdout)."""
    if argv[:1] != ["schedule"]:
        print(json.dumps(CostTable.from_step_bench(*argv, source=" + ".join(argv)), indent=1))
        return 0
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ddtree_patcher.patches.ddtree.payload.core.budget schedule")
    ap.add_argument("step_bench", nargs="+")
    ap.add_argument("--tau", required=True, help="budget=tokens per step, comma-separated")
    ap.add_argument("--chain-tau", type=float, default=None)
    ap.add_argument("--max-batch", type=int, default=64)
    a = ap.parse_args(argv[1:])
    try:
        tau = {int(k): float(v) for k, v in (x.split("=") for x in a.tau.split(","))}
        table = CostTable.load(CostTable.from_step_bench(*a.step_bench))
        out = batch_schedule(table, tau, a.max_batch, a.chain_tau)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(out, indent=1))
    except BrokenPipeError:  # `| head`: the reader left
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
