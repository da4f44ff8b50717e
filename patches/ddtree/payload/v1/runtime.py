"""DDTreeRuntime: the runner-side state of tree verification (one per model runner).

Hooks the patched runner calls, in step order:
  prepare()  after the slot mapping: tree rows get position = root + depth
  attach()   after the attention metadata: the CPU backend sees the tree mask
  (the sampler walks the tree; see sampler.py)
  commit()   after sampling: KV of the accepted path moves to the first slots after
             the root, positions go back to linear, and the drafter's context rows
             (aux hidden states, input ids) are permuted so the path comes first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import settings
from ..core import DDTree, ancestor_mask, chain_depths, chain_parents, reindex_parents
from ..gdn.cpu import gdn_commit
from ..stats import Stats


@dataclass
class Step:
    """The trees being verified in this step, in batch row order."""

    root_rows: list[int]  # global token row of each request's root (-1: no tree)
    num_drafts: list[int]
    tree: DDTree  # [N, Dmax] (chains for requests without a stored tree)
    linear_positions: torch.Tensor
    masks: list[torch.Tensor | None]  # per request: [1+d, 1+d] ancestor-or-self
    stash: list = field(default_factory=list)

    def visible(self, r: int, q_len: int, seq_len: int):
        """([q_len, seq_len] bool: which cached positions each query row may see,
        [q_len] the rows' positions: linear, tree rows at root + depth)."""
        ctx = seq_len - q_len
        new = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        pos = torch.arange(ctx, seq_len)
        m = self.masks[r]
        if m is not None:
            t = m.shape[0]
            new[q_len - t:, q_len - t:] = m.cpu()
            pos[q_len - t + 1:] = pos[q_len - t] + self.tree.depths[r, : t - 1].cpu()
        return torch.cat([torch.ones(q_len, ctx, dtype=torch.bool), new], dim=1), pos

    def stash_kv(self, layer, impl, kv_cache, key, value, slot_mapping) -> None:
        self.stash.append((layer, impl, kv_cache, key.clone(), value.clone(), slot_mapping))


class DDTreeRuntime:
    def __init__(self, runner):
        from .sampler import DDTreeSampler

        if type(self) is DDTreeRuntime and torch.device(runner.device).type != "cpu":
            # this runtime verifies with the CPU backend's tree attention; a CUDA
            # backend would ignore the tree mask and lose exactness
            raise NotImplementedError(
                "DDTreeRuntime verifies trees with the CPU attention backend; CUDA "
                "runners take cuda_runtime.CudaDDTreeRuntime (cuda_runtime.make_runtime)")
        self.runner = runner
        self.config = settings.of(runner.speculative_config)
        self.budget = self.config.budget
        self.depth = self.config.depth
        self.trees: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.step: Step | None = None
        self.walk = None
        self.stats = Stats()
        self.sampler = DDTreeSampler(self, runner.sampler)
        # the scheduler's grammar masks read the trees (v1/grammar.py, one process)
        self.config.channel.runtime = self

    # ---------------------------------------------------------------- proposer side
    def store_trees(self, req_ids, tree: DDTree) -> None:
        for i, rid in enumerate(req_ids):
            self.trees[rid] = (tree.tokens[i], tree.parents[i], tree.depths[i])

    def tree_of(self, req_id: str):
        """(tokens, parents) of the request's last proposed tree, or None."""
        stored = self.trees.get(req_id)
        return None if stored is None else stored[:2]

    def with_trees(self, req_ids, drafts):
        """The drafts the runner hands to the scheduler; a structured request's as
        TreeDrafts carrying its tree's parents (v1/grammar.py reads them where this
        runtime is in another process than the scheduler)."""
        from .grammar import TreeDrafts

        out = list(drafts)
        for i, rid in enumerate(req_ids):
            req = self.runner.requests.get(rid)
            params = getattr(req, "sampling_params", None)
            d = out[i]
            if not d or getattr(params, "structured_outputs", None) is None:
                continue
            stored = self.tree_of(rid)
            if stored is not None and stored[0][:len(d)].tolist() == list(d):
                out[i] = TreeDrafts(d, stored[1][:len(d)].tolist())
        return out

    def prune(self, req_id: str, keep: list[int]) -> bool:
        """Keep only nodes ``keep`` (ascending, every kept node's parent kept) of the
        request's stored tree, re-indexed in that order: the tree its next verify
        runs (v1/grammar.py drops the drafts a grammar forbids).  False: not done."""
        stored = self.trees.get(req_id)
        if stored is None:
            return False
        tok, par, dep = stored
        kept_par = reindex_parents(par, keep)
        if kept_par is None:
            return False  # a node whose parent is not kept: not a tree
        idx = torch.tensor(keep, dtype=torch.int64, device=tok.device)
        self.trees[req_id] = (tok[idx], kept_par.to(par.dtype), dep[idx])
        return True

    # ---------------------------------------------------------------- runner hooks
    def prepare(self, scheduler_output, total_tokens: int) -> None:
        """Give every tree row its depth position (slots stay linear)."""
        self.step, self.walk = None, None
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return
        runner = self.runner
        req_ids = runner.input_batch.req_ids
        qsl = runner.query_start_loc.cpu[: len(req_ids) + 1].tolist()
        for rid in list(self.trees):
            if rid not in runner.requests:
                del self.trees[rid]  # finished or preempted
        pos = runner.positions
        linear = pos[:total_tokens].clone()
        dev = pos.device
        n = len(req_ids)
        dmax = max((len(spec.get(r, ())) for r in req_ids), default=0)
        tokens = torch.zeros(n, max(dmax, 1), dtype=torch.int64, device=dev)
        parents = torch.full_like(tokens, -1)
        depths = torch.zeros_like(tokens)
        num = torch.zeros(n, dtype=torch.int64, device=dev)
        root_rows, num_drafts, masks = [], [], []
        for i, rid in enumerate(req_ids):
            drafts = spec.get(rid, ())
            d = len(drafts)
            num_drafts.append(d)
            if d == 0:
                root_rows.append(-1)
                masks.append(None)
                continue
            tok = torch.tensor(drafts, dtype=torch.int64, device=dev)
            stored = self.trees.get(rid)
            if stored is not None and torch.equal(stored[0][:d].to(dev), tok):
                par, dep = stored[1][:d].to(dev), stored[2][:d].to(dev)
            else:  # no tree for these tokens: verify them as a chain (still exact)
                par, dep = chain_parents(d, dev), chain_depths(d, dev)
            root = qsl[i + 1] - 1 - d
            root_rows.append(root)
            tokens[i, :d], parents[i, :d], depths[i, :d], num[i] = tok, par, dep, d
            pos[root + 1: root + 1 + d] = linear[root] + dep
            masks.append(None)
        tree = DDTree(tokens=tokens, parents=parents, depths=depths, num_nodes=num,
                      scores=torch.zeros(tokens.shape, device=dev), ancestor_mask=None,
                      position_offsets=torch.cat([torch.zeros_like(num)[:, None], depths], 1),
                      max_depth=int(depths.max().item()) if dmax else 0,
                      max_budget=tokens.shape[1])
        full = ancestor_mask(parents, max(tree.max_depth, 1), backend="torch")
        for i, d in enumerate(num_drafts):
            if d:
                masks[i] = full[i, : d + 1, : d + 1]
        self.step = Step(root_rows, num_drafts, tree, linear, masks)

    def attach(self, attn_metadata) -> None:
        """Mark this step's attention metadata so the backend runs tree attention."""
        if self.step is None:
            return
        groups = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for per_layer in groups:
            for md in {id(m): m for m in per_layer.values()}.values():
                try:
                    md.ddtree = self.step
                except AttributeError:
                    pass

    def attach_dummy(self, attn_metadata) -> None:
        """Dummy runs: nothing to mark (the CPU backend has no captured graphs)."""

    def take_step(self):
        """(step, walk) of the step being committed; the runtime forgets them."""
        step, walk = self.step, self.walk
        self.step, self.walk = None, None
        return step, walk

    def commit(self, aux_hidden_states) -> None:
        """After the walk: compact KV, restore linear positions, put path rows first."""
        step, walk = self.take_step()
        if step is None:
            return
        runner = self.runner
        runner.positions[: step.linear_positions.shape[0]] = step.linear_positions
        gdn_commit(step, walk)
        if walk is None:
            return
        rows, num_acc = walk.accepted_rows.cpu(), walk.num_accepted.cpu()
        src, dst, trees = [], [], []
        for i, root in enumerate(step.root_rows):
            if root < 0:
                continue
            trees.append(i)
            a = int(num_acc[i])
            for j in range(1, a + 1):
                r = int(rows[i, j])
                if r != j:
                    src.append(root + r)
                    dst.append(root + j)
        self.stats.observe(step.tree, walk.accepted_rows, walk.num_accepted, trees)
        if not src:
            return
        dev = runner.positions.device
        s = torch.tensor(src, dtype=torch.int64, device=dev)
        t = torch.tensor(dst, dtype=torch.int64, device=dev)
        for layer, impl, kv_cache, key, value, slots in step.stash:
            impl.do_kv_cache_update(layer, key[s], value[s], kv_cache, slots[t])
        for h in aux_hidden_states or ():
            h.index_copy_(0, t, h[s])
        ids = runner.input_ids.gpu
        ids.index_copy_(0, t, ids[s])
