"""GPU tests: they run on CUDA; without CUDA they run small sizes through the Triton
interpreter on the CPU.  TRITON_INTERPRET=1 is set here (before any kernel is defined)
unless you set it yourself, so the result does not depend on which other test folders
were collected first; TRITON_INTERPRET=0 without CUDA skips them."""

import importlib
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

PAYLOAD_PKG = "ddtree_patcher.patches.ddtree.payload"


def payload_module(name: str):
    """payload/<name> (dotted under payload/, e.g. "v2.step"), imported straight from the
    checkout; nothing of vLLM is imported."""
    return importlib.import_module(f"{PAYLOAD_PKG}.{name}")


def device() -> str:
    if HAS_CUDA:
        return "cuda"
    if INTERPRET:
        return "cpu"
    pytest.skip("needs CUDA (TRITON_INTERPRET=0 was set: no CPU interpreter run)")


def spec_config(budget: int, depth: int, **settings):
    """A stand-in SpeculativeConfig of a DDTree engine: the keys the runtimes read and
    the engine's DDTreeConfig (settings.py; ``settings``: its other fields)."""
    from types import SimpleNamespace

    cfg = payload_module("settings").DDTreeConfig(budget=budget, depth=depth, **settings)
    return SimpleNamespace(ddtree_budget=budget, ddtree_depth=depth, ddtree_config=cfg)


def deepest_path(tree, width: int):
    """accepted_rows [N, width] (-1 padded) / num_accepted [N] of a walk that accepts
    each tree's deepest node's path (CPU tensors)."""
    n = tree.parents.shape[0]
    rows = torch.full((n, width), -1, dtype=torch.int64)
    num = torch.zeros(n, dtype=torch.int64)
    for i in range(n):
        node, path = int(tree.depths[i].argmax()), []
        while node >= 0:
            path.append(node + 1)
            node = int(tree.parents[i, node])
        path = [0] + path[::-1]
        rows[i, : len(path)] = torch.tensor(path)
        num[i] = len(path) - 1
    return rows, num
