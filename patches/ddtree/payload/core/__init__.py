"""DDTree core: tree build, tree walk and KV compaction on the device.

Depends only on torch (Triton optional, used on CUDA; every function has a torch
path).  No vllm import, relative imports only: these files may be copied verbatim
into vLLM (e.g. vllm/v1/spec_decode/ddtree_core/).

Verify rows: row 0 = root (the bonus / last accepted token, position start),
row r = node r - 1 (position start + depth).  B = max_budget, L = draft positions.

build_tree(draft [N, L, V] logits, budget: int | LongTensor[N], max_budget,
           logprobs=False, backend='auto', topk='auto') -> DDTree
    Exactly Algorithm 1's node set (top-budget prefixes of prod_d q_d) with a fixed
    tie-break (tree_build docstring: scores are exact int sums of floor(lp*2**26);
    order = score desc, then shallower, then parent first, then lower rank; ranks
    are (log-prob desc, token id asc); the K = min(B, V) candidates per depth are
    the K largest by (value desc, id asc): vocab_topk).  Nodes in pop order,
    parents first; the first b nodes are the budget-b tree.
    DDTree fields: tokens, parents (-1 = root child), depths (1-based),
    num_nodes [N], scores, ancestor_mask [N, B+1, B+1] (row i attends j iff j is an
    ancestor-or-self of i; pads attend root + self), position_offsets [N, B+1]
    (0 root, depth for nodes), max_depth, max_budget.  Pad slots: token 0,
    parent -1, depth 0, score -inf, offset 0.  No host sync; CUDA-graph capturable
    after one warm-up call.
vocab_topk(x [..., V], k, with_lse=True, impl='auto') -> (values, ids, lse)
    One fused pass (two Triton launches on CUDA): top k by (value desc, id asc) and
    the float32 logsumexp; impl='torch' is the reference.
chain_parents(width, device), chain_depths(width, device): a chain's parents / depths
    (drafts verified without a tree).
build_chain_from_topk(vals, idx, max_budget, lse) -> DDTree
    The drafter's top-1 chain (DFlash's argmax drafts) as a chain-shaped DDTree;
    top1(vals, idx) -> (tokens [N, L], columns): just its tokens (for unsorted top-K;
    vocab_topk's output is in key order, so there column 0 is the top-1).
graphed.GraphedBuild(max_budget)(draft) -> Build(tree, vals, idx, lse, chain_scores)
    The per-step build replayed from a CUDA graph per batch bucket.
graphed.TopkTreeGraphs(max_budget): build_tree_from_topk replayed from a graph per
    batch size over the caller's static top-K buffers (eager for any other input).
budget.BudgetController: the cost-aware budget (per step: a tree size or the chain).
row_argmax(x [..., V], impl='auto') -> int64 [...]: torch.argmax's rule, the row spread
    over chunks on CUDA (impl='triton'; 'auto' follows row_argmax.AUTO).
walk_greedy(target argmax [N, B+1] or logits [N, B+1, V], tree) -> WalkResult
walk_sampled(target_probs [N, B+1, V], tree, uniforms [N, L+1]) -> WalkResult
    WalkResult(accepted_rows [N, L+1], output_tokens [N, L+1], num_accepted [N]):
    rows of the accepted path starting with 0, then accepted draft tokens followed
    by the bonus token, -1 padded (vLLM rejection-sampler format).  Sampled rule:
    one uniform per visited row, inverse CDF of the row's target distribution over
    "children in node order, then other tokens in id order" on exact 2**-40 integer
    masses; follow the child or emit the bonus (lossless, target-only).
target_probs(logits [N, R, V], temperature [N], top_k, top_p, min_p) -> probs
    vLLM 0.32.0 semantics; temperature < 1e-5 -> one-hot argmax.
compact_kv(kv_caches, block_table, block_size, start_positions [N], accepted_rows,
           num_accepted, layout) -> in place
    Moves K/V of row accepted_rows[n, j] (position start + row) to position
    start + j.  layout: 'kv_in_block' [blocks, 2, bs, H, D], 'kv_outer'
    [2, blocks, bs, H, D], 'heads_packed' [blocks, H, bs, 2D] (vLLM 0.32.0).
compaction_slots / compact_kv_slots: the same through slot ids.

prune_row(tree, i, keep) / reindex_parents(parents, keep): a tree cut to a subset of
    its nodes (a grammar's pruning), in place / the kept nodes' parents re-indexed.

gdn_tree: Gated DeltaNet layers on a tree (verify from the committed state, tree
    short convolution, commit along the accepted path); see its docstring.
paired_counts: the tree-vs-chain choice's counts of one tree step (V2 runner,
    sched/paired.py), one Triton launch on CUDA; see its docstring.

backend: 'auto' (Triton on CUDA tensors when importable, else torch), 'torch',
'triton' (CUDA, or CPU under TRITON_INTERPRET=1).  Both agree exactly.
"""

from ._triton import HAS_TRITON
from . import gdn_tree, paired_counts
from .kv_compact import LAYOUTS, compact_kv, compact_kv_slots, compaction_slots, token_view
from .prune import prune_row, reindex_parents
from .sampling import apply_top_k_top_p, target_probs
from .tree_build import (
    DDTree,
    ancestor_mask,
    build_chain_from_topk,
    build_tree,
    build_tree_from_topk,
    canonical_topk,
    chain_depths,
    chain_parents,
    chain_scores,
    quantize_logprobs,
    top1,
)
from .row_argmax import row_argmax
from .vocab_topk import row_logsumexp, vocab_topk
from .tree_walk import WalkResult, masses, walk_greedy, walk_sampled

__all__ = [
    "HAS_TRITON", "gdn_tree", "paired_counts", "DDTree", "build_tree", "build_tree_from_topk", "build_chain_from_topk", "chain_scores", "vocab_topk",
    "row_logsumexp", "row_argmax", "ancestor_mask", "canonical_topk", "top1", "chain_parents",
    "chain_depths",
    "quantize_logprobs", "WalkResult",
    "walk_greedy", "walk_sampled", "masses", "target_probs", "apply_top_k_top_p", "compact_kv",
    "compact_kv_slots", "compaction_slots", "token_view", "LAYOUTS", "prune_row",
    "reindex_parents",
]
