"""Core tests: torch references everywhere; Triton kernels on CUDA, or on the CPU
under the Triton interpreter (switched on here, before the kernels are defined)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
