"""Small helpers the tests share."""

from __future__ import annotations

import ast
import difflib
import hashlib
from pathlib import Path


TEXT = (".py", ".pyc", ".json", ".txt", ".md", "RECORD", "METADATA", "INSTALLER", "WHEEL")


def changed_lines(src: str, out: str) -> tuple[list[str], list[str]]:
    """The stripped lines a unified diff removes and adds (no context lines)."""
    removed, added = [], []
    for line in difflib.unified_diff(src.splitlines(), out.splitlines(), lineterm="", n=0):
        if line.startswith("-") and not line.startswith("---"):
            removed.append(line[1:].strip())
        elif line.startswith("+") and not line.startswith("+++"):
            added.append(line[1:].strip())
    return removed, added


def snapshot(site: Path) -> dict[str, str]:
    """Identity of every file under site: sha256 for sources, bytecode and metadata;
    (inode, size, mtime) for the large binaries, which any write would change."""
    out = {}
    for p in sorted(site.rglob("*")):
        if not p.is_file():
            continue
        if p.name.endswith(TEXT):
            out[str(p.relative_to(site))] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            st = p.stat()
            out[str(p.relative_to(site))] = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    return out


def load_function(source: str, qualname: str, glb: dict | None = None):
    """Compile one function (a method too) out of a real vLLM source file."""
    tree = ast.parse(source)
    parts = qualname.split(".")
    body = tree.body
    node = None
    for part in parts:
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                    and n.name == part)
        body = node.body
    node.decorator_list = []
    node.returns = None
    for a in node.args.args + node.args.kwonlyargs:
        a.annotation = None
    mod = ast.Module(body=[node], type_ignores=[])
    ns = dict(glb or {})
    exec(compile(mod, "<vllm>", "exec"), ns)
    return ns[parts[-1]]


def ddtree_cli(*args, state: Path, env: dict | None = None):
    """ddtree-patch in a subprocess (this interpreter) with its own state folder."""
    import os
    import subprocess
    import sys

    e = dict(os.environ, DDTREE_PATCH_STATE_DIR=str(state), **(env or {}))
    return subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", *map(str, args)],
                          capture_output=True, text=True, env=e)


def run_engine_spec(python: str, spec: dict, work: Path, tag: str) -> dict:
    """tests/engine/engine_runner.py with ``python`` (e.g. a patched env copy) on
    ``spec``; returns its "configs" (each config's ok/error left to the caller)."""
    import json
    import subprocess

    runner = Path(__file__).resolve().parent / "engine" / "engine_runner.py"
    spec_file, out_file = work / f"{tag}.spec.json", work / f"{tag}.out.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    p = subprocess.run([python, str(runner), str(spec_file), str(out_file)],
                       capture_output=True, text=True)
    assert out_file.is_file(), p.stderr[-4000:]
    return json.loads(out_file.read_text())["configs"]
