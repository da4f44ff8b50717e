#!/usr/bin/env bash
# .whl/ (ignored): what device calls 2+ carry beside the bundle's second half: this
# checkout's wheel, libcst and pyyaml (the device has click, not libcst), and the
# structured-output dependencies vLLM declares but the slim bundle leaves out
# (lm-format-enforcer, interegular, outlines_core: vLLM 0.33 imports its
# lm-format-enforcer backend to validate any structured-output request; run 20's
# grammar row died on it).  gdn_device.sh's install stage puts them on PYTHONPATH.
#   bash bench/gpu/make_whl.sh [PYTHON]      (PYTHON: a venv with `build` and pip)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:-${DEV_PYTHON:-$HOME/.cache/ddtree-patch/envs/dev/bin/python}}
mkdir -p .whl
rm -f .whl/ddtree_patch-*.whl
log=$(mktemp)
"$py" -m build --wheel -o .whl . >"$log" 2>&1 || { cat "$log"; exit 1; }
rm -rf build
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d .whl \
  libcst==1.9.0 pyyaml==6.0.4 lm-format-enforcer==0.11.3 interegular==0.3.3 outlines_core==0.2.14 2>&1 | grep -v "is ignored: it is neither" || true
rm -f "$log"
for w in libcst-1.9.0 PyYAML-6.0.4 lm_format_enforcer-0.11.3 interegular-0.3.3 outlines_core-0.2.14; do
  ls .whl/ | grep -qi "^${w}-" || { echo "make_whl: $w missing from .whl (pip download failed?)" >&2; exit 1; }
done
ls .whl && du -sh .whl
