"""Shared fixtures: real vLLM trees (from the real wheels), an isolated state folder,
and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from wheels import copy_tree, installed_tree  # noqa: E402


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("DDTREE_PATCH_STATE_DIR", str(d))
    monkeypatch.delenv("DDTREE_PATCH_FAULT", raising=False)
    return d


@pytest.fixture
def tree(tmp_path):
    """tree(dist, version, slim=False) -> a private copy of the pip-installed real wheel
    (slim: its Python files and dist-info only, see wheels.copy_tree)."""
    n = [0]

    def make(dist: str = "vllm", version: str = "0.20.2", slim: bool = False) -> Path:
        n[0] += 1
        return copy_tree(dist, version, tmp_path / f"site{n[0]}", slim=slim)

    return make


@pytest.fixture
def pristine():
    """pristine(dist, version) -> the shared template tree: read it, never write it."""
    return installed_tree


class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    @property
    def json(self):
        return json.loads(self.out)

    def __repr__(self):
        return f"<exit {self.code}\nstdout: {self.out[-2000:]}\nstderr: {self.err[-2000:]}>"


def run_cli(*args, env=None, check=None, **popen) -> Result:
    """ddtree-patch in a subprocess (the real console entry point).  ``env`` values of
    None remove the variable."""
    e = dict(os.environ)
    e.update(env or {})
    e = {k: v for k, v in e.items() if v is not None}
    p = subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", *map(str, args)],
                       capture_output=True, text=True, env=e, **popen)
    r = Result(p.returncode, p.stdout, p.stderr)
    if check is not None:
        assert r.code == check, r
    return r


@pytest.fixture
def cli():
    return run_cli
