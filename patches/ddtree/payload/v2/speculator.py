"""DDTreeSpeculator: V2's DFlashSpeculator turned into a tree drafter.

The runner verifies B = num_speculative_tokens draft rows per request; the drafter runs
L = min(ddtree_depth, B) mask queries (a tree of B nodes is never deeper than B), so it
is built with a speculative config of L steps: its query width, sampling buffers and
FULL CUDA graphs (DFlashCudaGraphManager, 1 + L queries per request) are all L-sized.
Inside the draft step (eager or captured) ``sample_draft`` keeps the top-K logits and
log-sum-exp of every position (K = min(B, vocab)) in fixed buffers; after it,
``propose`` builds the trees on the device (core.build_tree_from_topk, no host sync),
stores them by request-state slot for the next verify step and returns the [N, B]
tree tokens in pop order, which the runner writes to ``req_states.draft_tokens``.
When the runner asks for k <= ddtree_chain_budget drafts (vLLM's budget per batch
size), it returns the top-1 chain of the first k positions instead: no tree build, and
the next verify step runs as the chain (v2_runtime.py).  A draft step (and its graph,
keyed by the request count) for a batch size whose budget is a chain samples as
DFlash does (its argmax, no top-K pass); the kept top-K is then that token alone, so a
tree asked of such a step (a padded graph) is that chain, still exact.

``propose`` first commits the step just verified (V2DDTree.commit), so the DFlash
context logic reads the accepted path.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager

import torch

from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from .. import log, settings
from . import chain_graphs
from ..core import build_tree_from_topk
from ..core.graphed import TopkTreeGraphs
from ..core.vocab_topk import vocab_topk
from .step import SlotTrees

_PROPOSE = inspect.signature(DFlashSpeculator.propose)
BUILD_GRAPHS_MAX = 8  # tree batch sizes whose build is captured (ddtree_build_graphs)


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"
    _chain_mode = False  # a chain-arm draft (chain_graphs.py) is running
    chain_graphs = None  # the chain arm's draft graphs, or None
    build_graphs = None  # the tree build's graphs per batch size (TopkTreeGraphs), or None

    def __init__(self, vllm_config, device):
        spec = vllm_config.speculative_config
        cfg = self.ddtree_config = settings.of(spec)
        self.ddtree_budget = cfg.budget
        depth = min(cfg.depth, cfg.budget)
        self.chain_budget = min(cfg.chain_budget, depth)
        # read by _num_graph_context_tokens (from DFlashSpeculator.__init__ on)
        self._budget_at = budgets_by_batch_size(spec, vllm_config.scheduler_config.max_num_seqs)
        self._max_context = max(n * (k + 1) for n, k in enumerate(self._budget_at))
        draft_spec = copy.copy(spec)
        draft_spec.num_speculative_tokens = depth
        draft_cfg = copy.copy(vllm_config)
        draft_cfg.speculative_config = draft_spec
        super().__init__(draft_cfg, device)
        # model loading and attention setup see the engine's own speculative config
        self.vllm_config.speculative_config = spec
        if self.draft_logits is not None:
            raise ValueError("method='ddtree' builds its tree from the drafter's "
                             "distributions: draft_sample_method must stay 'greedy'")
        self.topk = min(cfg.budget, self.vocab_size)
        rows = self.max_num_reqs * depth
        self._top_vals = torch.zeros(rows, self.topk, dtype=torch.float32, device=device)
        self._top_idx = torch.zeros(rows, self.topk, dtype=torch.int64, device=device)
        self._lse = torch.zeros(rows, dtype=torch.float32, device=device)
        self.trees = SlotTrees(self.max_num_reqs, cfg.budget, device)
        self._chain_at = None if not self.chain_budget else \
            [0 < k <= self.chain_budget for k in self._budget_at]
        self.runtime = None  # V2DDTree, set when the runner builds it
        # the tree-vs-chain choice (arms.py): both arms' tokens, measured on tree steps
        self.expect = None
        sizes = self.tree_sizes()
        if cfg.budget_control == "auto" and self.chain_budget and sizes:
            from ..sched.paired import ArmExpect

            b = cfg.budget  # smaller trees priced too (reported, not played)
            self.expect = ArmExpect(sizes, self.chain_budget, depth, self.max_num_reqs,
                                    device, subtrees=(b // 2, b // 4), channel=cfg.channel)
        self.synthetic = None
        if cfg.synthetic:
            from ..synthetic import SyntheticDrafter

            self.synthetic = SyntheticDrafter.load(cfg.synthetic)

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        """Context rows a captured draft step stores: a verify step has 1 + K target
        rows per request, K = the budget of its batch size (rows past them are stored
        eagerly before the replay); the largest count for the largest batch (it sizes
        the staging buffer).  A chain-arm draft graph: 1 + C rows per request."""
        if self._chain_mode:
            return min(max(num_reqs, 1) * (self.chain_budget + 1), self.max_num_tokens)
        ks = self._budget_at
        rows = self._max_context if num_reqs >= len(ks) - 1 else \
            num_reqs * (ks[max(num_reqs, 1)] + 1)
        return min(rows, self.max_num_tokens)

    def sample_draft(self, hidden_states, *args, **kwargs):
        """Runs inside the draft step (and its CUDA graph): keep each position's top-K
        logits and log-sum-exp; the returned tokens are not used.  Batch sizes whose
        budget is a chain: DFlash's own sampling, kept as a top-1."""
        m = hidden_states.shape[0]
        if self.drafts_chain(m // max(self.num_speculative_steps, 1)):
            tokens = super().sample_draft(hidden_states, *args, **kwargs)
            self.keep_top1(tokens)
            return tokens
        logits = self.compute_draft_logits(hidden_states, 0)
        # one pass for top-K and lse (fused Triton for K <= 128 on CUDA); NaN / inf
        # drafter entries count as -inf, so they never enter a tree
        vals, idx, lse = vocab_topk(logits, self.topk)
        self._top_vals[:m].copy_(vals)
        self._top_idx[:m].copy_(idx)
        self._lse[:m].copy_(lse)
        return idx[:, 0]

    def drafts_chain(self, num_reqs: int) -> bool:
        """Is the budget of a batch of num_reqs requests a chain (<= chain_budget), or
        is a chain-arm draft running?"""
        if self._chain_mode:
            return True
        at = self._chain_at
        return at is not None and at[min(num_reqs, len(at) - 1)]

    def keep_top1(self, tokens: torch.Tensor) -> None:
        """Keep the draft tokens [m] as the kept top-K's only finite entries."""
        m = tokens.numel()
        self._top_idx[:m, 0].copy_(tokens.view(-1))
        self._top_vals[:m, 0].zero_()
        self._top_vals[:m, 1:].fill_(float("-inf"))
        self._lse[:m].zero_()

    # ---------------------------------------------------------------- chain-arm graphs
    def tree_sizes(self) -> list[int]:
        """Batch sizes whose budget is a tree (where the scheduler may play either)."""
        return [n for n, k in enumerate(self._budget_at) if n and k > self.chain_budget]

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        super().init_cudagraph_manager(cudagraph_mode)
        self.chain_graphs = None
        if self.chain_budget and self.ddtree_config.chain_graphs:
            self.chain_graphs = chain_graphs.make(self, self.tree_sizes())
            chain_graphs.log_state(self.chain_graphs)

    def capture(self) -> None:
        super().capture()
        if self.chain_graphs is not None:
            with self._chain_arm():
                super().capture()
        self.build_graphs = None
        if self.ddtree_config.build_graphs:
            self.capture_builds()

    def capture_builds(self) -> None:
        """The tree build after each draft step replays a CUDA graph per tree batch size
        up to BUILD_GRAPHS_MAX, over the kept top-K buffers, instead of its eager
        launches (ddtree_build_graphs=False: eager)."""
        graphs = TopkTreeGraphs(self.ddtree_budget)
        sizes = [n for n in self.tree_sizes() if n <= min(BUILD_GRAPHS_MAX, self.max_num_reqs)]
        done = []
        for n in sizes:
            try:  # a capture that fails leaves that batch size eager, never the engine down
                if graphs.capture(*self._kept_views(n)):
                    done.append(n)
            except Exception as e:  # noqa: BLE001
                log(__name__, "DDTree: capturing the tree build for %d requests failed "
                    "(%r): it stays eager", n, e, warn=True)
        self.build_graphs = graphs if done else None
        eager = [n for n in sizes if n not in done]  # off CUDA, or a replay not proven
        log(__name__, "DDTree: the tree build's own graphs (ddtree_build_graphs=False turns "
            "them off): captured and proven for batch sizes %s; eager for %s", done, eager,
            warn=bool(eager) and self._top_vals.is_cuda)

    @contextmanager
    def _chain_arm(self):
        """Draft as the chain arm: DFlash's sampling, 1 + C context rows, the chain
        arm's draft graphs."""
        main = self.query_cudagraph_manager
        self.query_cudagraph_manager, self._chain_mode = self.chain_graphs, True
        try:
            yield
        finally:
            self.query_cudagraph_manager, self._chain_mode = main, False

    @torch.inference_mode()
    def propose(self, *args, **kwargs):
        a = _PROPOSE.bind(self, *args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        if self.runtime is None:
            raise RuntimeError("method='ddtree' on the V2 runner needs its tree sampler; "
                               "this model replaced vLLM's rejection sampler")
        batch, dummy = a["input_batch"], a["dummy_run"]
        if not dummy:
            self.runtime.commit(batch, a["last_hidden_states"], a["aux_hidden_states"])
        want = a.get("num_speculative_tokens")
        if self.chain_graphs is not None and not dummy and want is not None and \
                0 < want <= self.chain_budget and not self.drafts_chain(batch.num_reqs):
            with self._chain_arm():  # the chain arm at a tree batch size
                super().propose(*args, **kwargs)
        else:
            super().propose(*args, **kwargs)
        if want == 0:  # no drafts wanted (0.33: skip_drafts)
            return torch.full((batch.num_reqs, self.ddtree_budget), -1, dtype=torch.int64,
                              device=self.device)
        return self.build_trees(batch, store=not dummy, want=want)

    def kept(self, batch, store: bool):
        """This step's kept top-K logits and token ids [N, L, K] and lse [N, L]
        (synthetic distributions for profile prompts when ``store``)."""
        n = batch.num_reqs
        vals, idx, lse = self._kept_views(n)
        if self.synthetic is not None and store:
            self._synthetic(batch, vals, idx, lse)
        return vals, idx, lse

    def _kept_views(self, n: int):
        """The kept top-K buffers of n requests: [n, L, K] values and ids, [n, L] lse
        (fixed addresses per n: the build's graphs read them)."""
        L, k = self.num_speculative_steps, self.topk
        return (self._top_vals[: n * L].view(n, L, k), self._top_idx[: n * L].view(n, L, k),
                self._lse[: n * L].view(n, L))

    def build_trees(self, batch, store: bool, want: int | None = None) -> torch.Tensor:
        """The [N, B] draft tokens: trees in pop order, stored by slot unless ``store``
        is False (dummy runs); for ``want`` <= chain_budget drafts, the top-1 chain of
        the first ``want`` positions (-1 after), nothing stored."""
        vals, idx, lse = self.kept(batch, store)
        if want is not None and 0 < want <= self.chain_budget:
            return chain_tokens(idx, want, self.ddtree_budget)
        if self.build_graphs is not None:  # replays where captured for these buffers
            tree = self.build_graphs(vals, idx, lse)
        else:
            tree = build_tree_from_topk(vals, idx, self.ddtree_budget, self.ddtree_budget,
                                        lse)
        if store:
            self.trees.store(batch.idx_mapping, tree)
            if self.expect is not None:  # the top-1 chain, to measure it on this tree
                self.expect.draft(vals, idx, lse, batch.idx_mapping)
        return tree.tokens

    def _synthetic(self, batch, vals, idx, lse) -> None:
        """Testing aid (ddtree_synthetic): requests whose prompt starts a profile
        sequence get its synthetic distributions (host work, eager)."""
        req_states = self.runtime.runner.req_states
        slots = batch.idx_mapping_np
        computed = req_states.num_computed_tokens.gpu[batch.idx_mapping].tolist()
        L = vals.shape[1]
        for i, slot in enumerate(slots.tolist()):
            plen = int(req_states.prompt_len.np[slot])
            prompt = req_states.all_token_ids.gpu[slot, :plen].tolist()
            # after post_update, the computed count is the bonus token's position
            rows = self.synthetic.distributions(prompt, computed[i], i, L, self.vocab_size)
            if rows is None:
                continue
            v, j, ls = vocab_topk(rows.to(vals.device), self.topk)  # key order
            vals[i], idx[i], lse[i] = v, j, ls


def budgets_by_batch_size(spec, max_reqs: int) -> list[int]:
    """[max_reqs + 1]: the drafts a batch of n requests verifies (vLLM's lookup of
    num_speculative_tokens_per_batch_size; B without one); index 0 unused (B)."""
    b = spec.ddtree_budget
    sched = getattr(spec, "num_speculative_tokens_per_batch_size", None)
    if not sched:
        return [b] * (max_reqs + 1)
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    lookup = build_dynamic_sd_schedule_lookup(sched, vllm_max_batch_size=max_reqs,
                                              vllm_num_speculative_tokens=b)
    return [b] + [min(k, b) if k > 0 else b for k in lookup[1:]]


def chain_tokens(idx: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """[N, width] int64: the top-1 token of positions 0..k-1 of the kept top-K ids
    [N, L, K] (kept in key order: column 0 is the top-1 by core.top1's rule), -1 after."""
    out = torch.full((idx.shape[0], width), -1, dtype=torch.int64, device=idx.device)
    out[:, :k] = idx[:, :k, 0]
    return out

