"""Pruning a built tree to a subset of its nodes (structured outputs: the nodes a
grammar forbids go with their subtrees before verify).

reindex_parents(parents [B], keep) -> [len(keep)] int64 or None
    The kept nodes' parents, re-indexed in the order of ``keep`` (ascending node
    indices, so parents stay before children; -1: the root); None when a kept node's
    parent is not kept (the set is not a tree).
prune_row(tree, i, keep) -> bool
    In place: request i of a DDTree keeps only nodes ``keep``, re-indexed, every other
    field to match (pads as the build writes them); False changes nothing.
"""

import torch

from .tree_build import DDTree, ancestor_mask_torch


def reindex_parents(parents: torch.Tensor, keep: list[int]) -> torch.Tensor | None:
    dev = parents.device
    idx = torch.tensor(keep, dtype=torch.int64, device=dev)
    new = torch.full((parents.shape[-1],), -1, dtype=torch.int64, device=dev)
    new[idx] = torch.arange(len(keep), device=dev)
    par = parents[idx].to(torch.int64)
    out = torch.where(par >= 0, new[par.clamp(min=0)], par)
    if bool(((par >= 0) & (out < 0)).any()):
        return None
    return out


def prune_row(tree: DDTree, i: int, keep: list[int]) -> bool:
    par = reindex_parents(tree.parents[i], keep)
    if par is None:
        return False
    k = len(keep)
    idx = torch.tensor(keep, dtype=torch.int64, device=tree.parents.device)
    for t, pad in ((tree.tokens, 0), (tree.depths, 0), (tree.scores, float("-inf"))):
        if t is not None:
            row = t[i, idx].clone()
            t[i].fill_(pad)
            t[i, :k] = row
    tree.parents[i].fill_(-1)
    tree.parents[i, :k] = par.to(tree.parents.dtype)
    if tree.num_nodes is not None:
        tree.num_nodes[i] = k
    if tree.position_offsets is not None:
        tree.position_offsets[i].zero_()
        tree.position_offsets[i, 1: k + 1] = tree.depths[i, :k]
    if tree.ancestor_mask is not None:
        tree.ancestor_mask[i] = ancestor_mask_torch(
            tree.parents[i: i + 1].to(torch.int64), tree.max_depth)[0]
    return True
