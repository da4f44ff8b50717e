"""Loading the bench scripts (bench/gpu/*.py: scripts, not a package) by path."""

import importlib.util
from pathlib import Path

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def load_bench(name: str):
    """bench/gpu/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", GPU_BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
