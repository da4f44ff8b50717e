"""DDTreeProposer: the DFlash drafter pass, turned into a tree of B draft tokens."""

from __future__ import annotations

import inspect

import torch

from vllm.v1.spec_decode.dflash import DFlashProposer

from .. import settings
from ..attention.features import check_target
from ..core import build_tree
from ..core.budget import BudgetController, CostTable, build_controlled

# vLLM 0.20.x: propose() has no num_speculative_tokens argument (the drafter reads
# self.num_speculative_tokens) and the DFlash early exit calls _greedy_sample
# (later releases: _sample_draft_tokens).
_PROPOSE_TAKES_K = "num_speculative_tokens" in inspect.signature(
    DFlashProposer.propose).parameters
_HAS_SAMPLE_DRAFT_TOKENS = hasattr(DFlashProposer, "_sample_draft_tokens")


class DDTreeProposer(DFlashProposer):
    """DFlash with L = ddtree_depth mask queries; returns [N, B] tree tokens in pop
    order and hands the tree (parents, depths) to the runner's DDTree runtime."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        cfg = self.ddtree_config = settings.of(vllm_config.speculative_config)
        self.ddtree_budget = cfg.budget
        self.ddtree_depth = cfg.depth
        self._ddtree_runner = runner
        self._ddtree_tokens = None
        self._ddtree_call = None
        self._ddtree_synthetic = None
        if cfg.synthetic:
            from ..synthetic import SyntheticDrafter

            self._ddtree_synthetic = SyntheticDrafter.load(cfg.synthetic)
        if not _PROPOSE_TAKES_K:
            # the drafter runs L mask queries (its buffers were sized for B >= L)
            self.num_speculative_tokens = self.ddtree_depth
        if getattr(self, "use_heterogeneous_vocab", False):
            raise ValueError("method='ddtree' needs the drafter to share the target's "
                             "vocabulary")
        # ddtree_budget_control='auto': a budget per step (core/budget.py); the last
        # choice's draft count is ddtree_last_budget (the runner slices its buffers)
        self.ddtree_controller = None
        self.ddtree_last_budget = self.ddtree_budget
        if cfg.budget_control == "auto":
            dev = torch.device(device)
            name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
            budgets = None if cfg.budgets is None else list(cfg.budgets)
            self.ddtree_controller = BudgetController(
                CostTable.for_device(name, cfg.cost_table), self.ddtree_budget,
                self.ddtree_depth, budgets, device=dev)

    def load_model(self, target_model) -> None:
        """Load the drafter, then refuse a target whose attention the tree attention
        does not serve (attention/features.py), before the engine serves a request."""
        super().load_model(target_model)
        layers = self.vllm_config.compilation_config.static_forward_context
        check_target(layers, getattr(self, "_draft_attn_layer_names", ()))

    def propose(self, *args, **kwargs):
        # The runner asks for K <= B tokens (K < B: vLLM's dynamic speculative decoding,
        # num_speculative_tokens_per_batch_size); the drafter itself runs L mask queries
        # and the first K nodes of the budget-B tree are the best tree of budget K.
        want = None
        if not _PROPOSE_TAKES_K:
            self.num_speculative_tokens = self.ddtree_depth
        elif args:
            want, args = args[0], (self.ddtree_depth,) + tuple(args[1:])
        else:
            want = kwargs.get("num_speculative_tokens")
            kwargs["num_speculative_tokens"] = self.ddtree_depth
        self._ddtree_call = kwargs
        self._ddtree_tokens = None
        out = super().propose(*args, **kwargs)
        tokens, self._ddtree_tokens, self._ddtree_call = self._ddtree_tokens, None, None
        if tokens is None:
            return out
        return tokens if want is None or want >= tokens.shape[1] else tokens[:, :want]

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        depth = self.num_speculative_tokens  # == ddtree_depth inside propose()
        logits = self.model.compute_logits(hidden_states).float()
        n = logits.shape[0] // depth
        logits = logits.view(n, depth, -1)
        if self._ddtree_synthetic is not None and self._ddtree_call is not None:
            logits = self._ddtree_synthetic.logits(self._ddtree_runner, self._ddtree_call,
                                                   n, depth, logits)
        runtime = getattr(self._ddtree_runner, "ddtree", None)
        ctl = self.ddtree_controller
        if ctl is None:
            tree = build_tree(logits, self.ddtree_budget, self.ddtree_budget)
            tokens = tree.tokens
        else:  # the step's budget (a prefix of the tree) or the top-1 chain
            tree, tokens, choice = build_controlled(logits, ctl)
            self.ddtree_last_budget = choice.budget
            stats = getattr(runtime, "stats", None)
            if stats is not None and stats.path is not None:
                stats.d.update(ctl.metrics())
        if runtime is not None:
            runtime.store_trees(self._ddtree_runner.input_batch.req_ids[:n], tree)
        self._ddtree_tokens = tokens
        return torch.zeros(n * depth, dtype=torch.long, device=logits.device), None

    def _greedy_sample(self, hidden_states):
        # 0.20.x: the DFlash early exit lands here; later releases go through
        # _sample_draft_tokens (above) and keep the plain greedy sample.
        if _HAS_SAMPLE_DRAFT_TOKENS or self._ddtree_call is None:
            return super()._greedy_sample(hidden_states)
        tokens, _ = self._sample_draft_tokens(hidden_states, None)
        return tokens
