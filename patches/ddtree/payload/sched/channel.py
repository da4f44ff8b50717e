"""ArmChannel: what the worker side tells the scheduler side when both run in one
process: the tree-vs-chain choice's counts (paired.py -> arms.py) and the V1 runtime's
trees (v1/runtime.py -> v1/grammar.py, structured outputs).

One per engine configuration (DDTreeConfig.channel): the scheduler's ArmLookup and the
worker's ArmExpect are handed the same object.  A process that unpickles the
configuration (a TP > 1 worker) gets its own copy, so nothing it publishes reaches the
scheduler, which then compares measured tokens (arms.py).
"""

from __future__ import annotations


class ArmChannel:
    def __init__(self):
        # set by the worker half when it runs in this process: its paired counts will
        # be published, so each arm needs fewer steps of its own to start
        self.paired = False
        # batch size -> (tokens per request-step of the tree, of the chain), both
        # measured on the same tree steps
        self.expected: dict[int, tuple[float, float]] = {}
        # batch size -> (var of the tree's count, var of the chain's, their covariance,
        # rows): the spread of the paired counts per request-step, for the choice's
        # error bar (rows: the effective number of the decayed rows, (sum w)^2 / sum w^2)
        self.spread: dict[int, tuple[float, float, float, float]] = {}
        # batch size -> {b: tokens per request-step of the best tree of b nodes}, priced
        # on the same tree steps (reported in the summary, not chosen)
        self.subtrees: dict[int, dict[int, float]] = {}
        # the V1 runtime (its tree_of() and Stats): the grammar masks per tree node
        # (v1/grammar.py) read the trees it proposed
        self.runtime = None

    def clear(self) -> None:
        """Forget every published count (a scheduler starting afresh)."""
        self.expected.clear()
        self.spread.clear()
        self.subtrees.clear()

    def publish(self, rows, subtrees=()) -> None:
        """rows[n] = [tree accepted sum, rows, chain accepted sum, rows, sums of tree^2,
        chain^2, tree x chain and of the rows' squared weights, then one accepted sum per
        subtree size in ``subtrees``] (paired.py; both counts come from the same rows)."""
        for n, row in enumerate(rows):
            t, tn, c, cn, t2, c2, tc, w2 = row[:8]
            if tn > 0 and cn > 0:
                self.expected[n] = (1.0 + t / tn, 1.0 + c / cn)
                mt, mc = t / tn, c / tn
                self.spread[n] = (max(t2 / tn - mt * mt, 0.0), max(c2 / tn - mc * mc, 0.0),
                                  tc / tn - mt * mc, tn * tn / w2 if w2 > 0 else tn)
                if subtrees:
                    self.subtrees[n] = {b: 1.0 + s / tn for b, s in zip(subtrees, row[8:])}
