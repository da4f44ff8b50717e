#!/usr/bin/env bash
# The whole H200 session in one command (after install_remote.sh put the patched vLLM
# 0.20.2 bundle in /tmp/vb).  Every stage has its own timeout and writes under $OUT,
# so a stage that fails or runs out of time leaves the others' results.
#   bash bench/gpu/run_all.sh            (env: OUT, STAGES="tests sweep eq v2eq splitbench core gdn
#                                         kernel bench v2bench repeat v2repeat tp",
#                                         BENCH_CONFIGS, T_TESTS, T_EQ, T_KERNEL, T_BENCH,
#                                         GPU_PATCH: the overlay of patched files, made by
#                                         bench/gpu/make_overlay.py; default .gpu-patch)
# Works for any bundle the shared recipes install at /tmp/vb (0.20.2, 0.32.0, 0.33.0).
set -u
FINAL=${OUT:-/tmp/out}   # what comes back (few files): results.tgz + the two JSONs
OUT=/tmp/work            # every stage writes here
mkdir -p "$OUT" "$FINAL"
export PYTHONPATH=/tmp/vb/vllm_slim:/tmp/vb/site:${PYTHONPATH:-}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
       VLLM_USE_FLASHINFER_SAMPLER=0  # 0.32/0.33 bundles carry no flashinfer
STAGES=${STAGES:-"tests sweep eq kernel bench"}
# the tree kernel's launch table: the sweep's picks (this run's or an earlier call's)
TUNING=/tmp/attn_tuning.json
BENCH_CONFIGS=${BENCH_CONFIGS:-"chain15 ddtree64 ddtree256 ddtree16 chain15async ddtree32 ddtree128 nospec"}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
start=$(date +%s)
# the payload travels with the working tree: refresh it in the installed bundle (a payload
# fix then needs no new bundle); a carried .gpu-patch/ (patched upstream files, same
# layout as site-packages) is laid over it too
PATCH_DIR=${GPU_PATCH:-.gpu-patch}
case "$PATCH_DIR" in /*) ;; *) PATCH_DIR="$ROOT/$PATCH_DIR";; esac
if [ -d "$PATCH_DIR" ]; then cp -r "$PATCH_DIR/." /tmp/vb/vllm_slim/; fi
DDT=/tmp/vb/vllm_slim/vllm/v1/spec_decode/ddtree
if [ -d /tmp/vb/vllm_slim/vllm ]; then
  rm -rf "$DDT" && mkdir -p "$DDT" && cp -r "$ROOT"/patches/ddtree/payload/. "$DDT/"
fi
find /tmp/vb/vllm_slim/vllm -name __pycache__ -path "*spec_decode*" -prune -exec rm -rf {} + 2>/dev/null
stamp() { echo "=== $(($(date +%s) - start))s $*"; }
# DEADLINE: seconds from now by which everything (tar included) must be done
DEADLINE=${DEADLINE:-540}
left() {  # left T: the stage's own limit T, cut to what the deadline leaves
  local l=$((DEADLINE - ($(date +%s) - start) - 20)); [ "$l" -gt "$1" ] && l=$1
  [ "$l" -lt 5 ] && l=5; echo $l; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for s in $STAGES; do
  if [ -s "$TUNING" ]; then export VLLM_DDTREE_ATTN_TUNING=$TUNING; fi
  case $s in
    tests)
      stamp tests
      (cd "$ROOT" && timeout "$(left ${T_TESTS:-90})" python3 -m pytest -q -p no:cacheprovider \
        ${GPU_TESTS:-tests/gpu} 2>&1 | tail -15) | tee "$OUT/pytest_gpu.txt" ;;
    sweep)
      stamp sweep
      env -u VLLM_DDTREE_ATTN_TUNING SWEEP_BUDGET_S=${T_SWEEP:-150} timeout "$(left $(( ${T_SWEEP:-150} + 60 )))" \
        python3 "$HERE/attn_sweep.py" "$OUT" 2>&1 | grep -v Warning | tail -12
      [ -s "$OUT/attn_tuning.json" ] && cp "$OUT/attn_tuning.json" "$TUNING" ;;
    eq)
      stamp equality
      VLLM_USE_V2_MODEL_RUNNER=0 timeout "$(left ${T_EQ:-170})" python3 "$HERE/equality.py" "$OUT" \
        > "$OUT/equality_log.txt" 2>&1  # the V1 runner (v2eq: the V2 runner)
      echo "rc=$?"; grep -E "SUMMARY|walk|eager tree|FAILED|Error" "$OUT/equality_log.txt" | cut -c1-400 | tail -20 ;;
    v2eq)  # the V2 runner: equality_v2.py, one configuration per row
      for row in ${V2EQ_ROWS:-TRITON_ATTN:graphs FLASH_ATTN:graphs}; do
        attn=${row%%:*}; g=""; [ "${row#*:}" = graphs ] && g="--graphs"
        stamp "v2eq $row"
        VLLM_USE_V2_MODEL_RUNNER=1 timeout "$(left ${T_V2EQ:-240})" \
          python3 "$HERE/equality_v2.py" "$OUT/v2_${attn}_${row#*:}" \
          --attn "$attn" $g ${V2EQ_ARGS:-} > "$OUT/v2eq_${attn}_${row#*:}.txt" 2>&1
        echo "rc=$?"; grep -E "PASS|FAIL|control|RESULT|Traceback|Error|DIFF|PROBLEM" \
          "$OUT/v2eq_${attn}_${row#*:}.txt" | cut -c1-300 | tail -24
      done ;;
    splitbench)  # split vs single-kernel tree attention vs FA3, per layer
      stamp splitbench
      timeout "$(left ${T_SPLIT:-200})" python3 "$HERE/split_attn_bench.py" "$OUT/split" \
        > "$OUT/split_log.txt" 2>&1
      echo "rc=$?"; grep -E "^\||Error" "$OUT/split_log.txt" | cut -c1-250 | tail -40 ;;
    core)  # tree build: fused top-K vs previous path vs CPU heap
      stamp core
      (cd "$ROOT" && timeout "$(left ${T_CORE:-150})" python3 bench/bench_core.py --only build \
        --out "$OUT/core" > "$OUT/core_log.txt" 2>&1)
      echo "rc=$?"; grep -E "target|^\|" "$OUT/core_log.txt" | cut -c1-250 | tail -30 ;;
    gdn)  # tree GDN vs chain GDN per layer (Qwen3.6-27B head sizes)
      stamp gdn
      (cd "$ROOT" && timeout "$(left ${T_GDN:-120})" python3 bench/gpu/gdn_bench.py "$OUT/gdn" \
        > "$OUT/gdn_log.txt" 2>&1)
      echo "rc=$?"; grep -E "^\||Error" "$OUT/gdn_log.txt" | cut -c1-250 | tail -20 ;;
    tp)  # two GPUs: DDTree at tensor_parallel_size=2 (tp_equality.py)
      stamp tp
      TP_DEADLINE_S=$(( $(left ${T_TP:-480}) - 30 )) timeout "$(left ${T_TP:-480})" \
        python3 "$HERE/tp_equality.py" "$OUT/tp" > "$OUT/tp_log.txt" 2>&1
      echo "rc=$?"; grep -E "SUMMARY|^\||FAILED|SKIPPED|done in" "$OUT/tp_log.txt" | cut -c1-900 | tail -30 ;;
    kernel)
      stamp kernel
      timeout "$(left ${T_KERNEL:-60})" python3 "$HERE/kernel_bench.py" "$OUT" 2>&1 | grep -v Warning | tail -20 ;;
    bench)
      stamp bench
      VLLM_USE_V2_MODEL_RUNNER=0 timeout "$(left ${T_BENCH:-600})" \
        python3 "$HERE/step_bench.py" "$OUT" $BENCH_CONFIGS \
        > "$OUT/bench_log.txt" 2>&1
      echo "rc=$?"; grep -E " N |e2e|FAILED|Error|engine" "$OUT/bench_log.txt" | cut -c1-330 | tail -60 ;;
    v2bench)  # the step table on the V2 runner (V2BENCH_E2E=1,16: also part (c) there)
      stamp v2bench
      VLLM_USE_V2_MODEL_RUNNER=1 BENCH_E2E_BATCHES=${V2BENCH_E2E:-} \
        timeout "$(left ${T_V2BENCH:-400})" \
        python3 "$HERE/step_bench.py" "$OUT/v2bench" ${V2BENCH_CONFIGS:-chain15 chain15async ddtree16 ddtree32 ddtree64} \
        > "$OUT/v2bench_log.txt" 2>&1
      echo "rc=$?"; grep -E " N [0-9]+ step|e2e|FAILED|Error" "$OUT/v2bench_log.txt" | cut -c1-200 | tail -60 ;;
    repeat)  # alternating fresh processes: chain vs tree step time, R rounds
      stamp repeat
      for i in $(seq "${REPEATS:-3}"); do
        for c in ${REPEAT_CONFIGS:-chain15 ddtree64}; do
          VLLM_USE_V2_MODEL_RUNNER=0 BENCH_BATCHES=${REPEAT_BATCHES:-1} BENCH_E2E_BATCHES= \
            timeout "$(left 150)" \
            python3 "$HERE/step_bench.py" "$OUT/repeat/r$i" "$c" > "$OUT/repeat_r${i}_$c.txt" 2>&1
          grep -E " N [0-9]+ step ms" "$OUT/repeat_r${i}_$c.txt" | cut -c1-60
        done
      done ;;
    v2repeat)  # V2: alternating fresh processes, step table + end to end, R rounds
      # (V2REPEAT_ROUNDS="2 3": round ids, to spread rounds over calls on one machine)
      stamp v2repeat
      for i in ${V2REPEAT_ROUNDS:-$(seq "${REPEATS:-3}")}; do
        for c in ${V2REPEAT_CONFIGS:-chain15async ddtree64chainasync}; do
          VLLM_USE_V2_MODEL_RUNNER=1 BENCH_BATCHES=${V2REPEAT_BATCHES:-1,4,16,32} \
            BENCH_E2E_BATCHES=${V2REPEAT_E2E:-1,2,4,16,32} BENCH_E2E_ALL=1 timeout "$(left ${T_V2REPEAT:-240})" \
            python3 "$HERE/step_bench.py" "$OUT/v2repeat/r$i" "$c" > "$OUT/v2repeat_r${i}_$c.txt" 2>&1
          grep -E " N [0-9]+ step ms|e2e" "$OUT/v2repeat_r${i}_$c.txt" | cut -c1-110
        done
      done
      python3 "$HERE/report.py" "$OUT" > "$OUT/v2repeat_report.md" 2>&1
      sed -n '/V2, repeated/,$p' "$OUT/v2repeat_report.md" | head -80 ;;
  esac
done
stamp done
[ -f "$OUT/v2bench/step_bench.json" ] && cp "$OUT/v2bench/step_bench.json" "$FINAL/v2_step_bench.json"
cp "$OUT"/step_bench.json "$OUT"/equality.json "$OUT"/attn_tuning.json "$OUT"/tp/tp_equality.json \
  "$FINAL"/ 2>/dev/null
for f in "$OUT"/v2_*/equality_v2.json; do [ -f "$f" ] && cp "$f" "$FINAL/$(basename "$(dirname "$f")").json"; done
tar czf "$FINAL/results.tgz" -C "$OUT" --exclude='*.safetensors' . && ls -la "$FINAL"
