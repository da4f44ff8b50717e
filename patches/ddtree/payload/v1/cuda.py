"""DDTree runtime for CUDA runners (vLLM 0.20.x FA / FlexAttention): same hooks and
step order as ``runtime.DDTreeRuntime`` (the CPU one), built for speed and CUDA graphs:

* no host syncs and few launches: per request, the host packs [drafts | stored-tree
  index | root row | draft tokens] (numpy, from what it already knows) into one pinned,
  non-blocking copy; core/step.py's ``prepare`` / ``commit`` do the rest in one Triton
  launch each (or their torch references there, where Triton is not);
* the tree attention reads its inputs from ``TreeState`` (fixed addresses), filled in
  ``prepare`` before the forward, so FULL CUDA graphs captured with the tree kernel
  replay correctly (``attach_dummy`` marks the capture runs' metadata);
* KV compaction moves the accepted path's K/V inside the paged cache of every target
  layer (``core.compact_kv``, one Triton launch), instead of re-writing stashed rows.

Trees are kept from the proposer's last call only (``store_trees``); drafts without a
tree (e.g. a request skipped for a step) are verified as a chain, which stays exact:
the mask, the positions and the walk always describe the same structure, and the
walk compares against the tokens that were actually scheduled.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import step as step_kernels
from ..core import DDTree, compact_kv, prune_row
from ..attention.triton_tree import TreeState
from .runtime import DDTreeRuntime


def make_runtime(runner):
    dev = getattr(runner, "device", "cpu")
    if torch.device(dev).type == "cuda":
        return CudaDDTreeRuntime(runner)
    return DDTreeRuntime(runner)


# attention implementations whose forward carries the tree hook, per KV layout
HOOKED = {"kv_outer": ("FlashAttentionImpl", "FlexAttentionImpl"),
          "heads_packed": ("FlashAttentionImpl", "TritonAttentionImpl")}


def _layout(kv, head_size) -> str | None:
    """The paged-KV layout of a layer's cache tensor, None if it is not one."""
    if not isinstance(kv, torch.Tensor):
        return None
    if kv.dim() == 5 and kv.shape[0] == 2:
        return "kv_outer"
    if kv.dim() == 4 and head_size and kv.shape[-1] == 2 * head_size:
        return "heads_packed"
    return None


def _groups_of(runner, layer_names) -> set[int]:
    """KV-cache groups holding these layers (empty when the runner has no config)."""
    cfg = getattr(runner, "kv_cache_config", None)
    wanted = set(layer_names)
    return {i for i, g in enumerate(getattr(cfg, "kv_cache_groups", ()) or ())
            if wanted & set(g.layer_names)}


class CudaStep:
    """What the sampler and commit() need of this step's trees."""

    def __init__(self, num_drafts, tree, pack):
        self.num_drafts = num_drafts  # list[int] per batch row (the sampler checks it)
        self.tree = tree  # DDTree [n, dmax]: scheduled tokens, parents, num_nodes
        self.pack = pack  # device int64 [nd | prev | roots], see core/step.py


class CudaDDTreeRuntime(DDTreeRuntime):
    def __init__(self, runner):
        super().__init__(runner)
        dev = runner.device
        self.max_reqs = runner.max_num_reqs
        self.state = TreeState(self.max_reqs, self.budget, dev, self.config.split_attn)
        self._latest = None  # ({req_id: row}, DDTree) from the proposer's last call
        self._dirty = False
        cap = 3 * self.max_reqs + self.max_reqs * max(self.budget, 1) + 16
        pin = torch.device(dev).type == "cuda"
        self._host = torch.zeros(cap, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(cap, dtype=torch.int64, device=dev)
        # fused Triton bookkeeping (core/step.py) on CUDA; the torch path elsewhere
        self.fused = step_kernels.use_fused(dev)
        width = self.max_reqs * max(self.budget, 1)
        self._wpar = torch.zeros(width, dtype=torch.int64, device=dev)
        self._src = torch.zeros(width, dtype=torch.int64, device=dev)
        self._dst = torch.zeros(width, dtype=torch.int64, device=dev)
        self._start = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self._neff = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self._caches = None
        self._layout = None
        self._group = 0
        self._block_size = None
        self.gdn = None  # gdn_cuda.py's GDNTree once the model is loaded (None: no GDN)
        self._gdn_looked = False

    def _attach_gdn(self) -> None:
        """The V1 runner builds this runtime before it loads the model: the GDN layers
        are found at the first dummy run (the memory profile) or step."""
        if not self._gdn_looked:
            from ..gdn.cuda import attach

            self._gdn_looked = True
            self.gdn = attach(self.runner, self.state, self.budget, self.depth)

    # ---------------------------------------------------------------- proposer side
    def store_trees(self, req_ids, tree: DDTree) -> None:
        self._latest = ({rid: i for i, rid in enumerate(req_ids)}, tree)

    def tree_of(self, req_id: str):
        if self._latest is None:
            return None
        index_of, tree = self._latest
        i = index_of.get(req_id)
        return None if i is None else (tree.tokens[i], tree.parents[i])

    def prune(self, req_id: str, keep: list[int]) -> bool:
        """Cut the request's row of the proposer's device tree (the one the next verify
        runs) to nodes ``keep``, re-indexed (core.prune_row); v1/grammar.py drops the
        drafts a grammar forbids.  False: not done (no tree of it here, or not a tree)."""
        if self._latest is None:
            return False
        index_of, tree = self._latest
        i = index_of.get(req_id)
        return i is not None and prune_row(tree, i, keep)

    # ---------------------------------------------------------------- runner hooks
    def prepare(self, scheduler_output, total_tokens: int) -> None:
        self.step, self.walk = None, None
        self._attach_gdn()
        latest, self._latest = self._latest, None
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            if self._dirty:
                self.state.has_tree.zero_()
                self._dirty = False
            return
        runner = self.runner
        self._target_caches()  # checks the backends before the first verify runs
        req_ids = runner.input_batch.req_ids
        n = len(req_ids)
        lists = [spec.get(rid, ()) for rid in req_ids]
        nd = np.fromiter((len(x) for x in lists), dtype=np.int64, count=n)
        dmax = int(nd.max())
        width = max(dmax, 1)
        qsl = np.asarray(runner.query_start_loc.np[1: n + 1], dtype=np.int64)
        roots = np.where(nd > 0, qsl - 1 - nd, -1)
        index_of, tree = latest if latest is not None else ({}, None)
        if tree is not None:
            prev = np.fromiter((index_of.get(rid, -1) if d else -1
                                for rid, d in zip(req_ids, nd)), dtype=np.int64, count=n)
        else:
            prev = np.full(n, -1, dtype=np.int64)
        # host -> device in one pinned copy: [nd | prev | roots | tokens]
        h = self._host_np
        h[:n], h[n: 2 * n], h[2 * n: 3 * n] = nd, prev, roots
        tok = h[3 * n: 3 * n + n * width].reshape(n, width)
        tok.fill(0)
        for i, x in enumerate(lists):
            if len(x):
                tok[i, : len(x)] = x
        total = 3 * n + n * width
        dev = self._dev[:total]
        dev.copy_(self._host[:total], non_blocking=True)
        pack = dev[: 3 * n]
        tok_d = dev[3 * n:].view(n, width)
        with_tree = int((prev >= 0).sum())
        parents = self._wpar[: n * width].view(n, width)
        step_kernels.prepare(pack, n, width, tree if with_tree else None, runner.positions,
                             self.state.has_tree, self.state.mask, parents, self.fused)
        self._dirty = True
        if self.gdn is not None:
            self.gdn.note_step()
        depth = self.depth if with_tree == int((nd > 0).sum()) else max(self.depth, dmax)
        walk_tree = DDTree(tokens=tok_d, parents=parents, depths=None, num_nodes=pack[:n],
                           scores=None, ancestor_mask=None, position_offsets=None,
                           max_depth=max(depth, 1), max_budget=width)
        self.step = CudaStep(nd.tolist(), walk_tree, pack)

    def attach(self, attn_metadata) -> None:
        """Mark the target's (causal) metadata: its layers run the tree kernel."""
        if self.step is None:
            return
        self._mark(attn_metadata)

    def attach_dummy(self, attn_metadata) -> None:
        """Dummy / CUDA-graph capture runs: mark them too, so FULL graphs hold the tree
        kernel (rows without trees are causal, so such a graph is right for any batch)."""
        self._attach_gdn()
        self.state.has_tree.zero_()
        self._dirty = False
        self._mark(attn_metadata)

    def _mark(self, attn_metadata) -> None:
        groups = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for per_layer in groups:
            for md in {id(m): m for m in per_layer.values()}.values():
                if getattr(md, "causal", None) is True:
                    try:
                        md.ddtree = self.state
                    except AttributeError:
                        continue

    def _target_caches(self):
        """Every target attention layer's paged KV (drafter layers and shared caches
        skipped), and its layout: "kv_outer" on 0.20.x, "heads_packed" on 0.32/0.33."""
        if self._caches is None:
            runner = self.runner
            draft = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
            seen, caches, layouts, names = set(), [], set(), []
            for name, layer in runner.compilation_config.static_forward_context.items():
                if name in draft or getattr(layer, "is_draft_layer", False) or \
                        not hasattr(layer, "impl"):
                    continue
                kv = getattr(layer, "kv_cache", None)
                if isinstance(kv, (list, tuple)):
                    kv = kv[0] if kv else None
                layout = _layout(kv, getattr(layer.impl, "head_size", None))
                if layout is None or kv.data_ptr() in seen:  # KV sharing between layers
                    continue
                impl = type(layer.impl).__name__
                if impl not in HOOKED[layout]:
                    # its forward would ignore the tree mask: refuse before any verify
                    raise NotImplementedError(
                        f"DDTree: target layer {name} runs {impl}, which has no tree "
                        f"attention; use one of {', '.join(HOOKED[layout])} (e.g. "
                        "attention_config={'backend': 'FLASH_ATTN'} or 'TRITON_ATTN')")
                seen.add(kv.data_ptr())
                names.append(name)
                caches.append(kv)
                layouts.add(layout)
            groups = _groups_of(runner, names)
            if len(groups) > 1:
                raise NotImplementedError(
                    "DDTree: the target's attention layers span several KV-cache groups "
                    f"({sorted(groups)}); KV compaction supports one group")
            self._group = groups.pop() if groups else 0
            if not caches or len(layouts) != 1:
                raise RuntimeError(
                    "DDTree: target KV caches must all be paged attention caches of one "
                    "layout ([2, blocks, block_size, heads, head_size] or [blocks, heads, "
                    f"block_size, 2 * head_size]); found {len(caches)} of {sorted(layouts)}")
            self._caches = caches
            self._layout = layouts.pop()
            self._block_size = caches[0].shape[2]
        return self._caches

    def commit(self, aux_hidden_states) -> None:
        step, walk = self.take_step()
        if step is None:
            return
        runner = self.runner
        if self.gdn is not None and walk is not None:  # GDN state along the path
            self.gdn.commit(walk.accepted_rows, walk.num_accepted, len(step.num_drafts))
        pack = step.pack
        n = pack.shape[0] // 3
        rows, nacc, src, dst, start, neff = step_kernels.commit_views(
            walk, n, pack.device, self._src, self._dst, self._start, self._neff)
        step_kernels.commit(pack, n, rows, nacc, runner.positions, runner.input_ids.gpu, src,
                            dst, start, neff, self.fused, self.budget)
        if walk is None:
            return
        if aux_hidden_states:  # the drafter's context: path rows first
            step_kernels.move_rows(list(aux_hidden_states), src, dst, self.fused)
        block_table = runner.input_batch.block_table[self._group].get_device_tensor(n)
        compact_kv(self._target_caches(), block_table, self._block_size, start, rows, neff,
                   self._layout)
        self._observe(step, walk)

    def _observe(self, step, walk) -> None:
        if self.stats.path is not None:
            trees = [i for i, d in enumerate(step.num_drafts) if d]
            self.stats.observe(step.tree, walk.accepted_rows, walk.num_accepted, trees)
