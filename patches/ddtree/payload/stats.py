"""Walk counters of a DDTree runtime (V1 and V2), written to $VLLM_DDTREE_STATS_FILE."""

from __future__ import annotations

import json
import os

import torch

from . import envs
from .core import DDTree


class Stats:
    """Walk counters; written to $VLLM_DDTREE_STATS_FILE (JSON) when it is set.  Under
    tensor parallelism every rank writes its own file (rank_path): identical files
    show that the ranks walked the same trees to the same paths."""

    def __init__(self):
        self.path = rank_path(envs.stats_file())
        self.d = {"steps": 0, "trees": 0, "accepted": 0, "accepted_per_depth": {},
                  "accepted_non_first_child": 0, "max_accepted": 0, "drafted": 0}

    def observe(self, tree: DDTree, rows: torch.Tensor, num_acc: torch.Tensor,
                trees: list[int]) -> None:
        if self.path is None:
            return
        self.d["steps"] += 1
        _count(self.d, "tree_steps_by_reqs", len(trees))
        rows, num_acc = rows.cpu(), num_acc.cpu()
        parents = tree.parents.cpu()
        for i in trees:
            a = int(num_acc[i])
            self.d["trees"] += 1
            self.d["drafted"] += int(tree.num_nodes[i])
            self.d["accepted"] += a
            self.d["max_accepted"] = max(self.d["max_accepted"], a)
            per = self.d["accepted_per_depth"]
            per[str(a)] = per.get(str(a), 0) + 1
            for j in range(1, a + 1):
                node = int(rows[i, j]) - 1
                parent = int(parents[i, node])
                siblings = (parents[i, :node] == parent).sum().item()
                if siblings:
                    self.d["accepted_non_first_child"] += 1
        self._write()

    def observe_chain(self, drafts: torch.Tensor, num_acc: torch.Tensor) -> None:
        """A chain step (ddtree_chain_budget): its drafts and accepts, apart from the
        trees'."""
        if self.path is None:
            return
        drafts, num_acc = drafts.cpu(), num_acc.cpu()
        rows = drafts > 0
        _count(self.d, "chain_steps_by_reqs", int(rows.sum()))
        for k, v in (("chain_steps", 1), ("chain_rows", int(rows.sum())),
                     ("chain_drafted", int(drafts.sum())),
                     ("chain_accepted", int(num_acc[rows].sum()))):
            self.d[k] = self.d.get(k, 0) + v
        self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f)
        os.replace(tmp, self.path)


def _count(d: dict, key: str, n: int) -> None:
    """d[key][str(n)] += 1 (steps by the number of requests they verified)."""
    by = d.setdefault(key, {})
    by[str(n)] = by.get(str(n), 0) + 1


def rank_path(path: str | None) -> str | None:
    """Rank 0 (and a single process) writes ``path``; rank r > 0 of a distributed
    world writes ``<stem>.rank<r><ext>``."""
    import torch.distributed as dist

    if path is None or not (dist.is_available() and dist.is_initialized()):
        return path
    rank = dist.get_rank()
    if rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"
