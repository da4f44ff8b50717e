"""GPU tests: they run on CUDA; without CUDA they run small sizes through the Triton
interpreter on the CPU.  TRITON_INTERPRET=1 is set here (before any kernel is defined)
unless you set it yourself, so the result does not depend on which other test folders
were collected first; TRITON_INTERPRET=0 without CUDA skips them."""

import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_PKG = {}


def payload_module(name: str):
    """Import payload/<name>.py as part of a package laid out as vLLM gets it
    (payload files + core/), without importing vllm."""
    if "pkg" not in _PKG:
        tmp = Path(tempfile.mkdtemp(prefix="ddtree_payload_"))
        pkg = tmp / "ddtree_payload_pkg"
        shutil.copytree(ROOT / "patches" / "ddtree" / "payload", pkg)
        shutil.copytree(ROOT / "ddtree_patcher" / "core", pkg / "core")
        sys.path.insert(0, str(tmp))
        _PKG["pkg"] = "ddtree_payload_pkg"
    return importlib.import_module(f"{_PKG['pkg']}.{name}")


def device() -> str:
    if HAS_CUDA:
        return "cuda"
    if INTERPRET:
        return "cpu"
    pytest.skip("needs CUDA (TRITON_INTERPRET=0 was set: no CPU interpreter run)")
