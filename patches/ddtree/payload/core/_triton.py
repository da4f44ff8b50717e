"""Guarded Triton import: the torch paths must work without a usable Triton."""

import os

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install in a CPU-only env
    triton = None
    tl = None
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor, backend: str) -> bool:
    """Pick the implementation: 'torch', 'triton', or 'auto' (triton on CUDA)."""
    if backend == "torch":
        return False
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' but triton is not importable")
        if not (t.is_cuda or interpreting()):
            raise RuntimeError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
        return True
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}")
    return HAS_TRITON and t.is_cuda


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()
