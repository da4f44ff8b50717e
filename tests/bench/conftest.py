"""Loading the bench scripts (bench/gpu/*.py: scripts, not a package) by path."""

import importlib.util
import os
from pathlib import Path

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def load_bench(name: str):
    """bench/gpu/<name>.py as a module.  The environment is restored after its import:
    the scripts set engine defaults at import (equality_v2.py: the V2 runner), which
    must not reach the engine tests' vLLM processes (CI, 2026-12-02: every CPU engine
    asked for the V2 runner and failed)."""
    saved = dict(os.environ)
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", GPU_BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return mod
