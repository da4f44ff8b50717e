"""Per-node request semantics of the tree walk on the V2 runner.

Every verify row gets the logits V2's own sampler would sample from after that row's
path, processed by V2's own code (``Sampler.apply_sampling_params``: logit bias,
allowed tokens and min_tokens, penalties, bad words, then temperature and min_p;
top-k / top-p stay with core.target_probs, as before).  Those processors read a chain
layout: a request's rows contiguous, row k at local position k, its draft history the
input ids of rows 1..k.  Bias, allowed tokens, min_tokens, temperature and min_p need
only the row's position, which a tree step has already set to root + depth, so they
run on the tree layout as it is.  Penalties and bad words read the rows before: for
them the tree is laid out as chains, one per leaf (root, the leaf's ancestors, the
leaf), each row processed in the chain of its first leaf and gathered back
(``leaf_chains``: one host sync, only for such requests).

Logprobs (``logprobs=N``, raw: the default ``logprobs_mode``) of the emitted tokens
come from the rows that emitted them, laid out as V2's rejection sampler lays them
out: the request's first ``num_sampled`` logits rows.
"""

from __future__ import annotations

import numpy as np
import torch

NO_LOGPROBS = -1  # vllm/v1/worker/gpu/sample/states.py: no request asked for logprobs


def _acting(p, slots_np) -> np.ndarray:
    """Which requests V2's logits processor ``p`` acts on (an unknown one: all)."""
    for name in ("use_logit_bias", "use_penalty"):
        if hasattr(p, name):
            return getattr(p, name)[slots_np]
    if hasattr(p, "num_bad_words"):
        return p.num_bad_words.np[slots_np] > 0
    return np.ones(len(slots_np), dtype=bool)


def needs_processing(sampler, slots_np) -> bool:
    """Does a request use what core.target_probs does not apply itself (logit bias,
    allowed tokens, min_tokens, penalties, bad words, min_p)?  Temperature, top-k and
    top-p stay there, so plain sampling keeps its single pass over the rows."""
    return bool(np.any(sampler.sampling_states.min_p.np[slots_np] != 0.0) or
                any(np.any(_acting(p, slots_np)) for p in sampler.logits_processors))


def path_dependent(sampler, slots_np) -> bool:
    """Does a request use a processor that reads its draft history (penalties, bad
    words)?"""
    return any(np.any(_acting(p, slots_np)) for p in sampler.logits_processors
               if not hasattr(p, "use_logit_bias"))


def leaf_chains(parents: list[list[int]], nodes: list[int], starts: list[int]):
    """The tree rows of every request as chains, one per leaf: (rows [M] int: the
    logits row of each chain entry, local [M]: its offset in its chain, back [R]: for
    each logits row the chain entry it is read back from).  ``parents[i][j]``: parent
    of node j of request i (-1: the root), ``nodes[i]`` its verified nodes,
    ``starts[i]`` its first logits row (n + 1 entries: the last is the row count).
    Rows past a request's verified nodes read back its root."""
    rows, local, back = [], [], [0] * starts[-1]
    for i, d in enumerate(nodes):
        s = starts[i]
        par = parents[i][:d]
        inner = set(par)
        leaves = [j for j in range(d) if j not in inner] or [-1]
        seen = set()
        for leaf in leaves:
            path, j = [], leaf
            while j >= 0:
                path.append(j)
                j = par[j]
            for k, node in enumerate([-1] + path[::-1]):
                r = s + 1 + node
                if r not in seen:
                    seen.add(r)
                    back[r] = len(rows)
                rows.append(r)
                local.append(k)
        for r in range(s + 1 + d, starts[i + 1]):  # drafts the walk does not read
            back[r] = back[s]
    return rows, local, back


def process(sampler, logits: torch.Tensor, batch, tree) -> torch.Tensor | None:
    """float32 logits [rows, V] in the verify layout, each row processed after its own
    path (temperature and min_p included, top-k / top-p not); None when no request of
    the batch needs more than temperature, top-k and top-p."""
    slots_np = batch.idx_mapping_np
    if not needs_processing(sampler, slots_np):
        return None
    pos = batch.positions[batch.logits_indices]
    ids = batch.input_ids[batch.logits_indices]
    upper = batch.seq_lens_cpu_upper_bound.numpy()
    if not path_dependent(sampler, slots_np):
        return sampler.apply_sampling_params(
            logits, batch.expanded_idx_mapping, batch.idx_mapping, slots_np, pos, ids,
            batch.expanded_local_pos, upper, skip_top_k_top_p=True)
    n = batch.num_reqs
    starts = batch.cu_num_logits_np[: n + 1].tolist()
    rows, local, back = leaf_chains(tree.parents[:n].tolist(),
                                    tree.num_nodes[:n].tolist(), starts)
    dev = logits.device
    rows_t = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    local_t = torch.tensor(local, dtype=torch.int32).to(dev, non_blocking=True)
    back_t = torch.tensor(back, dtype=torch.int64).to(dev, non_blocking=True)
    out = sampler.apply_sampling_params(
        logits[rows_t], batch.expanded_idx_mapping[rows_t], batch.idx_mapping, slots_np,
        pos[rows_t], ids[rows_t], local_t.to(batch.expanded_local_pos.dtype), upper,
        skip_top_k_top_p=True)
    return out[back_t]


def greedy_flags(sampler, batch) -> torch.Tensor:
    """[n] 0.0 for greedy requests, 1.0 for sampled ones: the temperature left to
    apply to rows V2 already divided by theirs."""
    t = sampler.sampling_states.temperature.gpu[batch.idx_mapping]
    return (t != 0).to(torch.float32)


def emitted_logprobs(sampler, logits, batch, rows, walk, sampled, num_sampled):
    """V2's LogprobsTensors of the emitted tokens (None: no request asked): entry j of
    request i at logits row cu[i] + j, from the verify row that emitted token j."""
    k = sampler.sampling_states.max_num_logprobs(batch.idx_mapping_np)
    if k == NO_LOGPROBS:
        return None
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    n = batch.num_reqs
    cu = batch.cu_num_logits[: n + 1].long()
    w = rows.shape[1]
    acc = walk.emitting_rows(w)
    j = torch.arange(w, device=cu.device)
    keep = j.unsqueeze(0) < (cu[1:] - cu[:-1]).unsqueeze(1)
    dst = (cu[:-1].unsqueeze(1) + j)[keep]
    total = int(batch.cu_num_logits_np[n])
    src = torch.zeros(total, dtype=torch.int64, device=cu.device)
    src[dst] = rows.gather(1, acc)[keep]
    tok = torch.zeros(total, dtype=torch.int64, device=cu.device)
    tok[dst] = sampled[:, :w].to(torch.int64).clamp(min=0)[keep]
    expanded = total != n
    return compute_topk_scores(
        logits[src], k, tok, batch.cu_num_logits_np[: n + 1].tolist() if expanded else None,
        logits_mode=sampler.logprobs_mode == "raw_logits")


def without_invalid(tree, invalid: torch.Tensor, cu_num_logits: torch.Tensor, n: int):
    """The tree with each request's nodes cut to those before its first invalid row
    (vLLM's ``grammar_invalid_drafts``: logit rows past the drafts the grammar checked,
    verified against a permissive mask; they are a suffix of the request's rows, so
    the nodes left are a pop-order prefix, a subtree)."""
    import dataclasses

    cu = cu_num_logits[: n + 1].long()
    valid = torch.cat([invalid.new_zeros(1, dtype=torch.long),
                       (~invalid).long().cumsum(0)])
    allowed = valid[cu[1:]] - valid[cu[:-1]] - 1  # valid rows after the root
    nodes = torch.minimum(tree.num_nodes, allowed.clamp(min=0).to(tree.num_nodes.dtype))
    return dataclasses.replace(tree, num_nodes=nodes)
