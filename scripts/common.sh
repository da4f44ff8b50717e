# Sourced by the scripts: one progress line per phase (stderr: a TTY and a log alike),
# and long commands run quietly: their output goes to a log file, a line every 15 s
# says they are still running (with their latest output line), and their log's end
# is shown when they fail.

SAY_AS=${SAY_AS:-ddtree}

say() { printf '[%s %s] %s\n' "$SAY_AS" "$(date +%H:%M:%S)" "$*" >&2; }

_QUIET_PID=
trap '[[ -n $_QUIET_PID ]] && kill "$_QUIET_PID" 2>/dev/null; exit 130' INT TERM

# quietly LOG CMD...: run CMD with its output in LOG; returns CMD's exit code
quietly() {
    local log=$1 t0=$SECONDS next=15 rc=0 last
    shift
    mkdir -p "$(dirname "$log")"
    "$@" >"$log" 2>&1 &
    _QUIET_PID=$!
    while kill -0 "$_QUIET_PID" 2>/dev/null; do
        sleep 1
        if ((SECONDS - t0 >= next)); then
            last=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-100 || true)
            say "    ... still running, $((SECONDS - t0)) s${last:+: $last}"
            next=$((next + 15))
        fi
    done
    wait "$_QUIET_PID" || rc=$?
    _QUIET_PID=
    if ((rc != 0)); then
        say "    FAILED (exit $rc) after $((SECONDS - t0)) s; the end of $log:"
        tail -n 30 "$log" >&2
    fi
    return "$rc"
}

# pip_summary LOG: what a quiet pip install did, in one line
pip_summary() {
    local n
    n=$(grep -o '^Successfully installed .*' "$1" | wc -w || true)
    if ((n > 2)); then echo "installed $((n - 2)) packages"; else echo "nothing new to install"; fi
}
