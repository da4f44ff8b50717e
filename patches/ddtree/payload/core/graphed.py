"""The proposer's per-step tree build replayed from CUDA graphs.

On vLLM 0.20.x the drafter runs eagerly (FULL_DECODE_ONLY graphs hold the target only),
so the build's launches (vocab top-K, tree, mask, chain scores: ~10 with their small
torch ops) cost host time every step.  The build is sync-free with static shapes, so
it can be captured once per batch bucket and replayed: the drafter's logits are copied
into a static buffer, the graph replays, the outputs are views of static tensors.

Outputs stay valid until the next call (the runtime consumes a step's tree in the
next verify step, before the next propose).  Off CUDA, or for batches above the
largest bucket, it runs eagerly (same results: the graph replays the same kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .tree_build import DDTree, build_tree_from_topk, chain_scores
from .vocab_topk import vocab_topk

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Build:
    """One step's build: the tree, the vocab top-K it came from, the chain's scores."""

    tree: DDTree
    vals: torch.Tensor
    idx: torch.Tensor
    lse: torch.Tensor | None
    chain_scores: torch.Tensor | None


def build_step(draft: torch.Tensor, max_budget: int, logprobs: bool = False,
               with_chain: bool = False) -> Build:
    """build_tree (budget = max_budget) keeping its top-K lists (and the chain's
    scores, for the budget controller)."""
    vals, idx, lse = vocab_topk(draft, min(max_budget, draft.shape[-1]), with_lse=not logprobs)
    tree = build_tree_from_topk(vals, idx, max_budget, max_budget, lse)
    return Build(tree, vals, idx, lse, chain_scores(vals, idx, lse) if with_chain else None)


class GraphedBuild:
    """build_step replayed from one CUDA graph per batch bucket (captured on first use)."""

    def __init__(self, max_budget: int, logprobs: bool = False, with_chain: bool = False,
                 buckets=BUCKETS):
        self.max_budget = max_budget
        self.logprobs = logprobs
        self.with_chain = with_chain
        self.buckets = tuple(sorted(buckets))
        self.graphs: dict = {}  # (bucket, L, V, dtype, device) -> (graph, input, Build)

    def _eager(self, draft):
        return build_step(draft, self.max_budget, self.logprobs, self.with_chain)

    def __call__(self, draft: torch.Tensor) -> Build:
        n, L, v = draft.shape
        bk = next((b for b in self.buckets if b >= n), None)
        if not draft.is_cuda or bk is None or torch.cuda.is_current_stream_capturing():
            return self._eager(draft)
        key = (bk, L, v, draft.dtype, draft.device)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bk, draft)
        graph, x, out = self.graphs[key]
        x[:n].copy_(draft)
        graph.replay()
        return _rows(out, n)

    def _capture(self, bk, draft):
        x = torch.zeros((bk,) + tuple(draft.shape[1:]), dtype=draft.dtype, device=draft.device)
        graph, out = capture(self._eager, x)
        return graph, x, out


def capture(fn, *args):
    """(graph, outputs) of ``fn(*args)`` captured in a CUDA graph, after one warm-up
    call on a side stream (compiles the kernels, caches the tables)."""
    dev = args[0].device
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def _rows(b: Build, n: int) -> Build:
    """The first n requests of a bucket's outputs (views)."""
    t = b.tree
    cut = lambda x: None if x is None else x[:n]  # noqa: E731
    tree = replace(t, tokens=t.tokens[:n], parents=t.parents[:n], depths=t.depths[:n],
                   num_nodes=t.num_nodes[:n], scores=t.scores[:n],
                   ancestor_mask=cut(t.ancestor_mask), position_offsets=t.position_offsets[:n])
    return Build(tree, b.vals[:n], b.idx[:n], cut(b.lse), cut(b.chain_scores))


class TopkTreeGraphs:
    """build_tree_from_topk replayed from one CUDA graph per batch size, reading the
    caller's own static top-K buffers (V2: the speculator's kept top-K, written by its
    draft graph): ``capture(vals, idx, lse)`` at start-up, then ``__call__`` with the
    same tensors replays.  Inputs at other addresses or shapes, off CUDA, or during
    another capture run eagerly (same kernels, same results), never a stale replay."""

    def __init__(self, max_budget: int):
        self.max_budget = max_budget
        self.graphs: dict = {}  # n -> (graph, input signature, DDTree outputs)

    def _eager(self, vals, idx, lse) -> DDTree:
        return build_tree_from_topk(vals, idx, self.max_budget, self.max_budget, lse)

    @staticmethod
    def _sig(*xs) -> tuple:
        return tuple(None if x is None else (x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                                             x.dtype, x.device) for x in xs)

    def capture(self, vals, idx, lse=None) -> bool:
        """Capture the build for these buffers (their batch size), then prove it: a
        probe top-K written into them must give the eager build's tree on replay (the
        buffers' contents are restored after).  False off CUDA or if the proof fails
        (nothing kept: that batch size builds eagerly)."""
        if not vals.is_cuda or torch.cuda.is_current_stream_capturing():
            return False
        graph, out = capture(self._eager, vals, idx, lse)
        bufs = [x for x in (vals, idx, lse) if x is not None]
        saved = [x.clone() for x in bufs]
        g = torch.Generator(device=vals.device).manual_seed(0)
        probe = torch.randn(*vals.shape[:2], 2 * vals.shape[2], device=vals.device,
                            generator=g) * 3
        for buf, new in zip(bufs, vocab_topk(probe, vals.shape[2], with_lse=lse is not None)):
            buf.copy_(new)
        graph.replay()
        ok = same_tree(out, self._eager(vals, idx, lse))
        for buf, old in zip(bufs, saved):
            buf.copy_(old)
        if ok:
            self.graphs[vals.shape[0]] = (graph, self._sig(vals, idx, lse), out)
        return ok

    def __call__(self, vals, idx, lse=None) -> DDTree:
        """The tree (outputs stay valid until the next call for this batch size)."""
        got = self.graphs.get(vals.shape[0])
        if got is None or got[1] != self._sig(vals, idx, lse) or \
                torch.cuda.is_current_stream_capturing():
            return self._eager(vals, idx, lse)
        got[0].replay()
        return got[2]


def same_tree(a: DDTree, b: DDTree) -> bool:
    """Every tensor field of two trees equal."""
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in
               ("tokens", "parents", "depths", "num_nodes", "scores", "position_offsets")) \
        and (a.ancestor_mask is None) == (b.ancestor_mask is None) and \
        (a.ancestor_mask is None or torch.equal(a.ancestor_mask, b.ancestor_mask))
