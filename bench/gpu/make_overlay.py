"""Patched vLLM files to lay over a stock vLLM bundle on the GPU machine.

    python bench/gpu/make_overlay.py VERSION OUT_DIR     (e.g. 0.32.0 .gpu-patch)

Applies every transform (ddtree-patch apply --no-verify) to a private copy of the real
wheel's tree (tests/wheels.py cache), then copies each file that differs from the
pristine tree, and each added file, into OUT_DIR under its site-packages path.  The
GPU scripts copy OUT_DIR over the installed bundle (bench/gpu/run_all.sh does), so the
device runs exactly what `ddtree-patch apply` writes.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from wheels import copy_tree, installed_tree  # noqa: E402


def main() -> None:
    version, out = sys.argv[1], Path(sys.argv[2])
    pristine = installed_tree("vllm", version)
    with tempfile.TemporaryDirectory() as tmp:
        site = copy_tree("vllm", version, Path(tmp) / "site")
        env = dict(os.environ, DDTREE_PATCH_STATE_DIR=str(Path(tmp) / "state"))
        subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", "apply", "--no-verify",
                        "--site-packages", str(site)], check=True, env=env)
        shutil.rmtree(out, ignore_errors=True)
        n = 0
        for p in sorted((site / "vllm").rglob("*.py")):
            rel = p.relative_to(site)
            old = pristine / rel
            if old.exists() and filecmp.cmp(p, old, shallow=False):
                continue
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dst)
            n += 1
    print(f"{n} patched or added files for vLLM {version} in {out}")


if __name__ == "__main__":
    main()
