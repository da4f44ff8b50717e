"""Worker half of the tree-vs-chain choice (arms.py): tokens per step of both arms,
measured on the same tree steps.

Accepted lengths vary from step to step as much as their mean, so comparing the tree's
steps with the chain's (other steps, other tokens) needs many steps.  A tree step
shows both arms at once: the walk's output (the accepted path, then the bonus token)
is the target's own continuation, so the chain's accepted length on that step is the
common prefix of the drafter's top-1 chain and that output.  Only past the bonus it
is unknown (the chain matched the bonus too: the tree left out the chain's next
node); there the rest is the drafter's expected run of the chain from that point
(sum over d of the product of its top-1 probabilities).  For sampled requests the
same holds: the walk draws each position's token from the target with the position's
own uniform, which a chain walk would have drawn too.  Each pair comes from one step,
so the ratio of the two arms is known after a few tree steps; the chain's own steps
add nothing.

The same step also prices every smaller tree exactly: the best tree of b nodes is the
first b nodes in pop order (a subtree, parents first), and its walk would have stopped
where the accepted path leaves it.  For ``subtrees`` (b > C) those counts are published
too (``channel.subtrees``, reported only: the choice plays B or C).

Sums per batch size stay on the device (no host sync); after each of the first PUBLISH
tree steps and then every PUBLISH-th they are copied to pinned memory without a sync
and published, at the next tree step whose copy has landed, to the engine's
ArmChannel (channel.py: ``expected``, tokens per request-step, bonus included), which
the scheduler's ArmLookup divides by its measured step times, with the paired spread
of the two counts (``spread``): the tree is played only where its edge clears its
error bar.  One process only (the scheduler and this worker hold the same channel:
vLLM's in-process executor, TP = 1); elsewhere the scheduler falls back to measured
tokens.
"""

from __future__ import annotations

import torch

from .. import log
from ..core.paired_counts import COLS, add_rows, keep_top1, use_fused
from .channel import ArmChannel

PUBLISH = 4  # measured tree steps between two copies of the sums to the host
# weight of the sums after each copy (older steps fade): about 40 rows remembered
# (76 effective).  Simulated (both halves, tests/gpu/test_arms.py, run 9's step
# times, the error-bar rule): at p60 the choice reached 0.99 of the tree's rate with
# 0.85, 0.998 with 0.9
KEEP = 0.9


class ArmExpect:
    def __init__(self, tree_sizes, chain: int, depth: int, max_reqs: int, device,
                 subtrees=(), channel: ArmChannel | None = None, fused: bool | None = None):
        self.tree_sizes = set(tree_sizes)  # batch sizes that have arms
        self.chain = min(chain, depth)  # C drafts of the chain arm
        self.subtrees = sorted({b for b in subtrees if b > self.chain})
        self.fused = fused  # core/paired_counts.py's kernels (None: on CUDA / interpreted)
        # per batch size: tree accepted sum, rows, chain accepted sum, rows, the sums of
        # tree^2, chain^2 and tree x chain and of the rows' squared weights (the
        # choice's error bar), then the accepted sum of each subtree
        cols = COLS + len(self.subtrees)
        self.sums = torch.zeros(max_reqs + 1, cols, dtype=torch.float32, device=device)
        # older steps fade: every column by KEEP, the squared weights by KEEP^2
        self.fade = torch.full((cols,), KEEP, dtype=torch.float32, device=device)
        self.fade[7] = KEEP * KEEP
        # the top-1 chain of each request-state slot's last tree draft
        self.top1 = torch.zeros(max_reqs, max(self.chain, 1), dtype=torch.int64,
                                device=device)
        # and its log-probabilities (the expected rest of a chain the tree left out)
        self.logp = torch.zeros(max_reqs, max(self.chain, 1), dtype=torch.float32,
                                device=device)
        self._subs = torch.tensor(self.subtrees, dtype=torch.int64, device=device)
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(max_reqs + 1, cols, dtype=torch.float32, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.calls = 0
        self.pending = False
        # the scheduler holding this channel will get paired counts
        self.channel = ArmChannel() if channel is None else channel
        self.channel.paired = True

    def reset(self) -> None:
        """Forget every measured step (benchmarks: each cell starts afresh)."""
        self.sums.zero_()
        self.calls = 0
        self.pending = False

    def draft(self, vals, idx, lse, slots) -> None:
        """A tree draft (kept top-K logits and ids [n, L, K] in key order, so column 0
        is each position's top-1; lse [n, L]): keep its top-1 chain and the chain's
        log-probabilities by slot for the verify step."""
        if self.chain:
            self._fused_or_reference(keep_top1, vals, idx, lse, slots, self.top1, self.logp,
                                     self.chain)

    def verified(self, n: int, slots, output_tokens, num_accepted, valid,
                 accepted_rows=None) -> None:
        """A verified tree step of n requests (slots; the walk's output [n, >= 1]: the
        accepted drafts then the bonus, -1 after; valid: rows that had a tree;
        accepted_rows [n, L + 1]: verify rows of the path, root first, -1 after): the
        tree's accepted drafts, the chain's and each subtree's on the same step join
        the sums of n."""
        if n not in self.tree_sizes or not self.chain:
            return
        # one Triton launch on CUDA (core/paired_counts.py), its torch reference elsewhere
        self._fused_or_reference(add_rows, self.sums, n, slots, self.top1, self.logp,
                                 self.chain, output_tokens, num_accepted, valid,
                                 accepted_rows, self._subs if self.subtrees else None)
        self._publish()

    def _fused_or_reference(self, f, *args) -> None:
        """f's kernel (on CUDA or interpreted, unless ``fused`` says otherwise) or its
        reference; a kernel that fails to launch (a compile error: raised before it
        writes anything) turns the kernels off with one warning, and the counts go on
        from the torch references."""
        if self.fused is None:
            self.fused = use_fused(self.sums.device)
        if not self.fused:
            return f(*args, fused=False)
        try:
            return f(*args, fused=True)
        except Exception as e:  # noqa: BLE001 - the step must go on
            self.fused = False
            log(__name__, "the paired counts' kernels failed (%r); their torch "
                "references from now on", e, warn=True)
            return f(*args, fused=False)

    # ---------------------------------------------------------------- to the scheduler
    def _publish(self) -> None:
        self.calls += 1
        if self.pending and (self.event is None or self.event.query()):
            self.pending = False
            self.channel.publish(self.host.tolist(), self.subtrees)
        # the first PUBLISH steps each (so that the choice starts early), then every
        # PUBLISH-th, when older steps fade
        early = self.calls < PUBLISH
        if (early or self.calls % PUBLISH == 0) and not self.pending:
            self.host.copy_(self.sums, non_blocking=self.event is not None)
            if not early:
                self.sums.mul_(self.fade)
            if self.event is not None:
                self.event.record()
            self.pending = True
