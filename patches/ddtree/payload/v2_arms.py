"""Worker half of the tree-vs-chain choice (arms.py): expected tokens per arm.

Accepted lengths are too noisy to compare the tree and the chain from a few steps
(at p80-like acceptance one step's length varies as much as its mean), so the choice
takes them from the drafter's own probabilities instead, for both arms at once: every
SAMPLE-th draft at a tree batch size gives E[tree] = sum of the nodes' calibrated path
probabilities (on tree steps) and E[chain] = the same over the top-1 chain's C
prefixes (every step).  The calibration per depth (core.budget.BudgetController) learns
from what each verified step accepted, tree and chain steps alike.  Sums per batch size
stay on the device (no host sync); every PUBLISH measured drafts they are copied to pinned memory without a
sync and published, one period later, to ``arms.EXPECTED`` (tokens per request-step,
bonus included), which the scheduler's ArmLookup divides by its measured step times.
One process only (the scheduler and this worker share ``arms``: vLLM's in-process
executor, TP = 1); elsewhere the scheduler falls back to measured tokens.
"""

from __future__ import annotations

import torch

from . import arms
from .core.budget import BudgetController
from .core.tree_build import chain_scores

SAMPLE = 4  # one draft in SAMPLE (and its verify) is measured: host time per step
PUBLISH = 4  # measured drafts between two copies of the sums to the host
KEEP = 0.7  # weight of the sums after each copy (older drafts fade)


class ArmExpect:
    def __init__(self, tree_sizes, chain: int, depth: int, max_reqs: int, device):
        self.tree_sizes = set(tree_sizes)  # batch sizes that have arms
        self.chain = chain
        self.depth = depth
        self.ctrl = BudgetController(None, max_budget=max(chain, 1), depth=depth,
                                     chain=True, device=device)
        # per batch size: E[tree] sum, tree drafts, E[chain] sum, drafts
        self.sums = torch.zeros(max_reqs + 1, 4, dtype=torch.float32, device=device)
        # what each request-state slot last drafted, for the calibration at its verify
        self.chain_sc = torch.zeros(max_reqs, depth, dtype=torch.float32, device=device)
        self.tree_sc = None  # [max_reqs, B] scores and depths of the slot's tree
        self.tree_depths = None
        self.max_reqs = max_reqs
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(max_reqs + 1, 4, dtype=torch.float32, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.calls = 0
        self.drafts = 0
        self.pending = False
        self.measured = False  # was the draft now being verified measured?

    # ---------------------------------------------------------------- each draft
    def draft(self, n: int, vals, idx, lse, slots, tree=None) -> None:
        """A draft of n requests at a tree batch size (slots: their request-state
        slots): the chain's prefix scores are kept for calibration; E[chain], and
        E[tree] when ``tree`` was built, join the sums of batch size n."""
        self.measured = False
        if n not in self.tree_sizes:
            return
        self.drafts += 1
        if self.drafts % SAMPLE:
            return
        self.measured = True
        # device ops only: no host value enters a CUDA tensor here (that would sync)
        c = self.ctrl.calibration()
        sc = chain_scores(vals, idx, lse)[:, : self.depth]
        self.chain_sc[slots] = sc
        k = min(self.chain, sc.shape[1])
        row = self.sums[n]
        row[2:3].add_((torch.exp(sc[:, :k]) * c[1: k + 1]).sum())
        row[3:4].add_(n)
        if tree is not None:
            if self.tree_sc is None:
                shape = (self.max_reqs, tree.scores.shape[1])
                self.tree_sc = torch.full(shape, float("-inf"), device=sc.device)
                self.tree_depths = torch.zeros(shape, dtype=torch.int64, device=sc.device)
            self.tree_sc[slots] = tree.scores.float()
            self.tree_depths[slots] = tree.depths.long()
            w = c[tree.depths.long().clamp(0, self.depth)] * torch.exp(tree.scores.float())
            row[0:1].add_(w.sum())
            row[1:2].add_(n)
        self._publish()

    def verified(self, slots, num_accepted, chain: bool, num_nodes=None, valid=None,
                 k_chain: int = 0) -> None:
        """A verified step of the requests in ``slots``: a tree step (num_nodes nodes
        verified per request, valid = rows that had a tree) or a chain step (k_chain
        drafts each).  Only for measured drafts (one in SAMPLE)."""
        if not self.measured:
            return
        self.measured = False
        if not chain:
            if self.tree_sc is not None:
                self.ctrl.observe(self.tree_sc[slots], self.tree_depths[slots], num_nodes,
                                  num_accepted, valid)
            return
        sc = self.chain_sc[slots][:, :k_chain]
        depths = torch.arange(1, k_chain + 1, device=sc.device).expand_as(sc)
        nodes = torch.full((sc.shape[0],), k_chain, dtype=torch.int64, device=sc.device)
        self.ctrl.observe(sc, depths, nodes, num_accepted)

    # ---------------------------------------------------------------- to the scheduler
    def _publish(self) -> None:
        self.calls += 1
        if self.pending and (self.event is None or self.event.query()):
            self.pending = False
            arms.publish(self.host.tolist())
        if self.calls % PUBLISH == 0 and not self.pending:
            self.host.copy_(self.sums, non_blocking=self.event is not None)
            self.sums.mul_(KEEP)
            if self.event is not None:
                self.event.record()
            self.pending = True
