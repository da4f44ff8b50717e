"""DDTree runtime for CUDA runners (vLLM 0.20.x FA / FlexAttention): same hooks and
step order as ``runtime.DDTreeRuntime`` (the CPU one), built for speed and CUDA graphs:

* no host syncs: the per-step index arrays are built with numpy from what the host
  already knows (scheduled draft lists, query_start_loc) and go to the device in one
  pinned, non-blocking copy; everything else stays on the device;
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

from .core import DDTree, compact_kv
from .cuda_attention import TreeState
from .runtime import DDTreeRuntime


def make_runtime(runner):
    dev = getattr(runner, "device", "cpu")
    if torch.device(dev).type == "cuda":
        return CudaDDTreeRuntime(runner)
    return DDTreeRuntime(runner)


class CudaStep:
    """What the sampler and commit() need of this step's trees."""

    def __init__(self, num_drafts, tree, roots, fix):
        self.num_drafts = num_drafts  # list[int] per batch row (the sampler checks it)
        self.tree = tree  # DDTree [n, dmax]: scheduled tokens, parents, num_nodes
        self.roots = roots  # [n] int64 device: token row of each root, -1 = no drafts
        self.fix = fix  # (tok_rows, root_rows, j) of the rows given tree positions


class CudaDDTreeRuntime(DDTreeRuntime):
    def __init__(self, runner):
        super().__init__(runner)
        dev = runner.device
        self.max_reqs = runner.max_num_reqs
        self.state = TreeState(self.max_reqs, self.budget, dev)
        self._latest = None  # ({req_id: row}, DDTree) from the proposer's last call
        self._dirty = False
        cap = 2 * self.max_reqs + 6 * self.max_reqs * (self.budget + 1) + 16
        pin = torch.device(dev).type == "cuda"
        self._host = torch.zeros(cap, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(cap, dtype=torch.int64, device=dev)
        self._caches = None
        self._block_size = None

    # ---------------------------------------------------------------- proposer side
    def store_trees(self, req_ids, tree: DDTree) -> None:
        self._latest = ({rid: i for i, rid in enumerate(req_ids)}, tree)

    # ---------------------------------------------------------------- runner hooks
    def prepare(self, scheduler_output, total_tokens: int) -> None:
        self.step, self.walk = None, None
        latest, self._latest = self._latest, None
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            if self._dirty:
                self.state.has_tree.zero_()
                self._dirty = False
            return
        runner = self.runner
        req_ids = runner.input_batch.req_ids
        n = len(req_ids)
        lists = [spec.get(rid, ()) for rid in req_ids]
        nd = np.fromiter((len(x) for x in lists), dtype=np.int64, count=n)
        dmax = int(nd.max())
        qsl = np.asarray(runner.query_start_loc.np[1: n + 1], dtype=np.int64)
        roots = np.where(nd > 0, qsl - 1 - nd, -1)
        index_of, tree = latest if latest is not None else ({}, None)
        if tree is not None:
            prev = np.fromiter((index_of.get(rid, -1) if d else -1
                                for rid, d in zip(req_ids, nd)), dtype=np.int64, count=n)
        else:
            prev = np.full(n, -1, dtype=np.int64)
        hi = np.nonzero(prev >= 0)[0]
        d_h = nd[hi]
        m = int(d_h.sum())
        rep = np.repeat(np.arange(len(hi)), d_h)
        j = np.arange(m, dtype=np.int64) - np.repeat(np.cumsum(d_h) - d_h, d_h)
        tok = np.zeros((n, max(dmax, 1)), dtype=np.int64)
        for i, x in enumerate(lists):
            if len(x):
                tok[i, : len(x)] = x
        has = np.zeros(self.max_reqs, dtype=np.int64)
        has[hi] = 1
        parts = [has, tok.reshape(-1), nd, prev, roots, hi.astype(np.int64), prev[hi],
                 roots[hi][rep] + 1 + j, roots[hi][rep], prev[hi][rep], j]
        sizes = [p.size for p in parts]
        total = sum(sizes)
        np.concatenate(parts, out=self._host_np[:total])
        dev = self._dev[:total]
        dev.copy_(self._host[:total], non_blocking=True)
        views = list(torch.split(dev, sizes))
        (has_d, tok_d, nd_d, prev_d, roots_d, hi_d, prev_hi_d, tok_rows, root_rows,
         prev_rows, j_d) = views
        tok_d = tok_d.view(n, -1)
        st = self.state
        st.has_tree.copy_(has_d)
        self._dirty = True
        fix = None
        if m:
            pos = runner.positions
            pos[tok_rows] = pos[root_rows] + tree.depths[prev_rows, j_d]
            st.mask[hi_d] = tree.ancestor_mask[prev_hi_d].view(torch.int8)
            fix = (tok_rows, root_rows, j_d)
        width = tok_d.shape[1]
        chain = torch.arange(-1, width - 1, device=dev.device).expand(n, width)
        if tree is not None and len(hi):
            par_t = tree.parents[prev_d.clamp(min=0), :width]
            parents = torch.where((prev_d >= 0).unsqueeze(1), par_t, chain)
        else:
            parents = chain
        depth = self.depth if len(hi) == int((nd > 0).sum()) else max(self.depth, dmax)
        walk_tree = DDTree(tokens=tok_d, parents=parents, depths=None, num_nodes=nd_d,
                           scores=None, ancestor_mask=None, position_offsets=None,
                           max_depth=max(depth, 1), max_budget=width)
        self.step = CudaStep(nd.tolist(), walk_tree, roots_d, fix)

    def attach(self, attn_metadata) -> None:
        """Mark the target's (causal) metadata: its layers run the tree kernel."""
        if self.step is None:
            return
        self._mark(attn_metadata)

    def attach_dummy(self, attn_metadata) -> None:
        """Dummy / CUDA-graph capture runs: mark them too, so FULL graphs hold the tree
        kernel (rows without trees are causal, so such a graph is right for any batch)."""
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
        if self._caches is None:
            runner = self.runner
            draft = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
            seen, caches = set(), []
            for name, layer in runner.compilation_config.static_forward_context.items():
                if name in draft or not hasattr(layer, "impl"):
                    continue
                kv = getattr(layer, "kv_cache", None)
                if isinstance(kv, (list, tuple)):
                    kv = kv[0] if kv else None
                if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[0] != 2:
                    continue
                if kv.data_ptr() in seen:  # KV sharing between layers
                    continue
                seen.add(kv.data_ptr())
                caches.append(kv)
            if not caches:
                raise RuntimeError("DDTree: no target KV caches of the FA/Flex layout "
                                   "[2, blocks, block_size, heads, head_size] found")
            self._caches = caches
            self._block_size = caches[0].shape[2]
        return self._caches

    def commit(self, aux_hidden_states) -> None:
        step, walk = self.step, self.walk
        self.step, self.walk = None, None
        if step is None:
            return
        runner = self.runner
        pos = runner.positions
        if step.fix is not None:  # back to linear positions (the drafter reads them)
            tok_rows, root_rows, j = step.fix
            pos[tok_rows] = pos[root_rows] + j + 1
        if walk is None:
            return
        rows = walk.accepted_rows.long()
        nacc = walk.num_accepted.long()
        roots = step.roots
        valid = roots >= 0
        width = rows.shape[1] - 1
        jj = torch.arange(1, width + 1, device=rows.device)
        ok = (jj.unsqueeze(0) <= nacc.unsqueeze(1)) & valid.unsqueeze(1)
        src = torch.where(ok, roots.unsqueeze(1) + rows[:, 1:], 0).reshape(-1)
        dst = torch.where(ok, roots.unsqueeze(1) + jj.unsqueeze(0), 0).reshape(-1)
        for h in aux_hidden_states or ():  # the drafter's context: path rows first
            h[dst] = h[src]
        ids = runner.input_ids.gpu
        ids[dst] = ids[src]
        caches = self._target_caches()
        n = roots.shape[0]
        start = pos[roots.clamp(min=0)]
        block_table = runner.input_batch.block_table[0].get_device_tensor(n)
        compact_kv(caches, block_table, self._block_size, start, rows,
                   torch.where(valid, nacc, 0), "kv_outer")
        if self.stats.path is not None:
            trees = [i for i, d in enumerate(step.num_drafts) if d]
            self.stats.observe(step.tree, walk.accepted_rows, walk.num_accepted, trees)
