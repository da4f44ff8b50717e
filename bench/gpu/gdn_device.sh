#!/usr/bin/env bash
# The device sessions (issues 27-32; first written for GDN on CUDA), run as a user would: the stock slim
# vLLM bundle, `ddtree-patch apply --python python3`, `ddtree-patch verify`, then the
# GPU tests and the equality / speed runs.  Repo root on the device:
#   call 1 (carry .gpu-b1):           mkdir -p /tmp/vbparts && cp .gpu-b1/* /tmp/vbparts/
#   call 2+ (carry .gpu-b2 .whl):     STAGES="install apply tests eq" bash bench/gpu/gdn_device.sh
# .gpu-b1/.gpu-b2: bench/gpu/pack_calls.sh BUNDLE (+ record_trim.py of ../shared/gpu/v0_3x
# in .gpu-b2); .whl: libcst and this project's wheel (the device has click, not libcst).
# Stages: install (bundle + record_trim + the tool), apply (status, apply, verify),
# tests (GPU tests of the GDN path), eq / eqg (equality_gdn eager / FULL graphs),
# eqb (bf16 with the DFlash control), chisq (sampled walk, chisq_gdn.py), profile
# (gdn_profile.py, PROFILE_CONFIGS), fp32 (issue 28's tiny dense fp32 rows, V1 + V2),
# fp32ieee (the V2 rows with Triton's fp32 dots in IEEE),
# bench (GDN layer: tree vs chain), step (27B-shape
# step, STEP_CONFIGS one process each), startup (engine start-up, #29), grammar (host cost of
# structured-output masks, #32), e2e (step phases and end-to-end tokens/s, step_bench.py:
# the 27B shape, or E2E_SHAPE=qwen3_8b), kprof (the decode step by kernel, kernel_prof.py).
# VERIFY=0: apply without `verify`.
# Everything writes under $OUT; EQ_ROWS / EQG_ROWS pick rows (IEEE_ROWS: fp32ieee's extra
# row flags, default "--features-row --grammar-row --json-row").
# A fresh machine compiles vLLM's Triton kernels at its first engine start (~150 s for
# the tiny hybrid): run `apply` with verify (it starts that engine) before eq / step, or
# give the first engine stage that time (run 14's eq and step calls timed out on it).
# The next session (30 device minutes; what each earlier one did: bench/gpu/DEVICE_LOG.md):
# call 0 (no carry, no bundle): `TOPK_FROM_CHECKOUT=1 python3 bench/gpu/topk_bench.py
# $OUT/topk` (the split top-K select and the Triton argmax against the engine's kernels,
# ~1 min) and, on an H200 especially, `SWEEP_FROM_CHECKOUT=1
# SWEEP_STAGE1=table SWEEP_SHAPES=1x63,2x63 SWEEP_BUDGET_S=80 python3
# bench/gpu/attn_sweep.py $OUT/sweep` (stage 2 around the built-in table; if one wins,
# keep attn_tuning.json and export VLLM_DDTREE_ATTN_TUNING to it below, as runs 24-25 did);
# if topk_bench's new kernels win, add ddtree63chainasyncsplitargmax (and kprof of it) to
# the e2e configs below: the same engine with them;
# call 1 (carry .gpu-b1) as above; call 2 (carry .gpu-b2 .whl, after
# `bash bench/gpu/make_whl.sh`): STAGES="install apply" with VERIFY=0, then e2e rounds
# (run 26: 3 rounds of 4 configs in ~700 s, one round a call after the first):
#   E2E_SHAPE=qwen3_8b BENCH_E2E_NEW=256 E2E_BATCHES=1,2,4 E2E_STEP=1,2
#   BENCH_PROFILES=p60,p80,p90,real BENCH_REAL_PROFILE=bench/gpu/profiles/realpair_h100_1.json
#   E2E_ROUNDS="1" E2E_CONFIGS="chain15async ddtree64autoasync ddtree63chainasync
#   ddtree64autoktasync" STAGES=e2e   (~55 s per config and round; read with
#   bench/gpu/e2e_logs.py DIR --fixed ddtree63chainasync, --decode, --estimates, --stalls);
# kprof (KPROF_BATCHES=1,2 KPROF_CONFIGS="chain15async ddtree63chainasync", ~165 s),
# fp32ieee after any kernel change (~265 s); startup with
# STARTUP_CONFIGS=ddtree64autoasync,chain15async (run 26 ran the chain first each call).
# The device returns at most 8 files a call: tar $OUT into one.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
       VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
# VB / PARTS: where the bundle unpacks / its parts wait (a second vLLM version beside the
# first: VB=/tmp/vb32 PARTS=/tmp/vbparts32 B2=.gpu-b32b, call 1 copying .gpu-b32a there)
VB=${VB:-/tmp/vb} PARTS=${PARTS:-/tmp/vbparts} B2=${B2:-.gpu-b2}
export PYTHONPATH=$VB/vllm_slim:$VB/site:/tmp/ddt
start=$(date +%s)
stamp() { echo "=== $(($(date +%s) - start))s $*"; }
# left T: a stage's timeout, at most what is left of LIMIT (default 580 s) minus 15 s
left() { local r=$(( ${LIMIT:-580} - ($(date +%s) - start) - 15 )); [ "$r" -lt "$1" ] && echo $(( r > 5 ? r : 5 )) || echo "$1"; }
DDT="python3 -m ddtree_patcher.cli"
for s in ${STAGES:-install apply tests eq}; do
  case $s in
    install)
      stamp install
      if [ ! -d "$VB/vllm_slim" ]; then
        cp "$B2/aa2" "$B2/part_ab" "$PARTS/"
        cat "$PARTS/aa1" "$PARTS/aa2" > "$PARTS/part_aa" && rm "$PARTS/aa1" "$PARTS/aa2"
        SKIP_IMPORT_CHECK=1 bash "$PARTS/install_remote.sh" "$PARTS" "$VB" 2>&1 | tail -3
        python3 "$B2/record_trim.py" "$VB/vllm_slim"
      fi
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ddt .whl/*.whl 2>&1 | tail -2
      $DDT --version 2>&1 | tail -1 ;;
    apply)
      stamp apply
      (cd /tmp && $DDT status --python python3; $DDT apply --python python3; echo "apply rc=$?"
       if [ "${VERIFY:-1}" = 1 ]; then timeout $(left 300) $DDT verify --python python3; echo "verify rc=$?"; fi
      ) 2>&1 | tee "$OUT/apply_verify.txt" | tail -40 ;;
    tests)
      stamp tests
      timeout $(left ${T_TESTS:-240}) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gdn_cuda_path.py \
        tests/gpu/test_gdn_tree.py 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt" ;;
    eq)
      stamp eq eager
      timeout $(left ${T_EQ:-400}) python3 bench/gpu/equality_gdn.py "$OUT/eq_eager" \
        --rows "${EQ_ROWS:-ddtree,ddtree_n1,ddtree_n2,ddtree_default,ddtree_swa,ddtree_v1}" \
        > "$OUT/eq_eager.txt" 2>&1; echo "rc=$?"; grep -vE "^(INFO|WARNING|DEBUG)|it/s\]" "$OUT/eq_eager.txt" | tail -40 ;;
    eqg)
      stamp eq graphs
      timeout $(left ${T_EQG:-540}) python3 bench/gpu/equality_gdn.py "$OUT/eq_graphs" --graphs \
        --rows "${EQG_ROWS:-ddtree,ddtree_n1,ddtree_default,ddtree_swa,ddtree_eager}" \
        > "$OUT/eq_graphs.txt" 2>&1; echo "rc=$?"; grep -vE "^(INFO|WARNING|DEBUG)|it/s\]" "$OUT/eq_graphs.txt" | tail -40 ;;
    eqb)
      stamp eq bf16
      timeout $(left ${T_EQB:-400}) python3 bench/gpu/equality_gdn.py "$OUT/eq_bf16" --dtype bfloat16 \
        --rows "${EQB_ROWS:-ddtree,ddtree_v1,dflash}" > "$OUT/eq_bf16.txt" 2>&1; echo "rc=$?"
      grep -vE "^(INFO|WARNING|DEBUG)|it/s\]" "$OUT/eq_bf16.txt" | tail -30 ;;
    bench)
      stamp gdn bench
      timeout $(left ${T_BENCH:-200}) python3 bench/gpu/gdn_bench.py --out "$OUT/gdn_bench.json" ${GDN_BENCH_ARGS:-} 2>&1 | tail -30 ;;
    step)  # the 27B-shape step bench, one process per config (teardown keeps GPU memory)
      for cfg in ${STEP_CONFIGS:-dflash ddtree16}; do
        stamp step $cfg
        timeout $(left ${T_STEP:-300}) python3 bench/gpu/gdn_step_bench.py "$OUT/step_$cfg" $cfg \
          --batches ${STEP_BATCHES:-1,2} --rounds ${STEP_ROUNDS:-3} > "$OUT/step_$cfg.txt" 2>&1
        grep -vE "^(INFO|WARNING|DEBUG)|it/s\]" "$OUT/step_$cfg.txt" | tail -6
      done ;;
    chisq)  # the sampled walk's chi-square on the GPU path (V2 and V1, FULL graphs)
      stamp chisq
      timeout $(left ${T_CHISQ:-300}) python3 bench/gpu/chisq_gdn.py "$OUT/chisq" --rows ${CHISQ_ROWS:-v2,v1} \
        > "$OUT/chisq.txt" 2>&1; echo "rc=$?"; grep -vE "^(INFO|WARNING|DEBUG)|it/s\]" "$OUT/chisq.txt" | tail -12 ;;
    profile)  # where a step's time goes: torch profiler, 27B shape, 1 request (PROFILE_CONFIGS)
      for cfg in ${PROFILE_CONFIGS:-ddtreechain dflash ddtree16}; do
        stamp profile $cfg
        # PROFILE_FIRST=1: a request's first steps (gdn_profile.py --first)
        f=$([ "${PROFILE_FIRST:-0}" = 1 ] && echo _first)
        timeout $(left ${T_PROFILE:-200}) python3 bench/gpu/gdn_profile.py "$OUT/profile" $cfg \
          ${f:+--first} > "$OUT/profile_$cfg$f.log" 2>&1; echo "rc=$?"
        head -c 1500 "$OUT/profile/profile_$cfg$f.txt"
      done ;;
    fp32)  # issue 28: the tiny dense Qwen3 fp32 equality rows, V1 (equality.py, EQ_TAGS
      # fp32_triton: graphs + eager) and V2 (equality_v2.py, FULL graphs, TRITON_ATTN, the
      # default schedule and issue 32's request features)
      stamp fp32 v1
      VLLM_USE_V2_MODEL_RUNNER=0 EQ_TAGS=fp32_triton timeout $(left ${T_FP32:-240}) \
        python3 bench/gpu/equality.py "$OUT/fp32_v1" > "$OUT/fp32_v1.txt" 2>&1; echo "rc=$?"
      grep -E "SUMMARY|FAILED|Error" "$OUT/fp32_v1.txt" | cut -c1-600 | tail -8
      stamp fp32 v2
      VLLM_USE_V2_MODEL_RUNNER=1 timeout $(left ${T_FP32:-240}) python3 bench/gpu/equality_v2.py \
        "$OUT/fp32_v2" --graphs --attn TRITON_ATTN --default-row --features-row > "$OUT/fp32_v2.txt" 2>&1; echo "rc=$?"
      grep -E "PASS|FAIL|RESULT|Traceback|Error|DIFF" "$OUT/fp32_v2.txt" | cut -c1-300 | tail -12 ;;
    fp32ieee)  # the V2 fp32 rows with Triton's fp32 dots in IEEE everywhere (vLLM's Triton
      # attention runs them as TF32 by default: the reference's own rounding; run 17)
      stamp fp32 ieee
      TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton_ieee VLLM_USE_V2_MODEL_RUNNER=1 \
        timeout $(left ${T_FP32:-300}) python3 bench/gpu/equality_v2.py "$OUT/fp32_v2_ieee" \
        --graphs --attn TRITON_ATTN ${IEEE_ROWS:---features-row --grammar-row --json-row} > "$OUT/fp32_v2_ieee.txt" 2>&1; echo "rc=$?"
      grep -E "PASS|FAIL|RESULT|Traceback|Error|DIFF" "$OUT/fp32_v2_ieee.txt" | cut -c1-300 | tail -12 ;;
    startup)  # issue 29: engine start-up, DDTree's V2 default vs DFlash at the same
      # max_num_seqs, vLLM's capture sizes (startup_bench.py; 8B shape unless BENCH_SHAPE;
      # STARTUP_FRESH=1 on a session's first startup call: cold Triton caches)
      stamp startup
      VLLM_USE_V2_MODEL_RUNNER=1 timeout $(left ${T_STARTUP:-560}) python3 bench/gpu/startup_bench.py \
        "$OUT/startup" --configs "${STARTUP_CONFIGS:-chain15async,ddtree64autoasync}" \
        --seqs "${STARTUP_SEQS:-1,8,64,256}" --rounds ${STARTUP_ROUNDS:-1} \
        $([ "${STARTUP_FRESH:-0}" = 1 ] && echo --fresh) > "$OUT/startup.txt" 2>&1; echo "rc=$?"
      grep -vE "^(INFO|WARNING|DEBUG)" "$OUT/startup.txt" | tail -14 ;;
    grammar)  # #32: the host cost of structured-output masks per step, chain vs tree,
      # one fill at a time vs xgrammar's batch fill (bench/grammar_bench.py; no GPU use)
      stamp grammar
      timeout $(left ${T_GRAMMAR:-240}) python3 bench/grammar_bench.py --threads "${GRAMMAR_THREADS:-1,8}" \
        --json "$OUT/grammar_bench.json" > "$OUT/grammar_bench.txt" 2>&1; echo "rc=$?"
      grep "^|\|setup" "$OUT/grammar_bench.txt" | tail -30 ;;
    kprof)  # #29: the 8B-shape decode step by kernel (step_bench.py BENCH_TPROFILE=1, random
      # drafter: every step a full verify; no e2e), then kernel_prof.py's tables per batch
      for c in ${KPROF_CONFIGS:-chain15async ddtree64chainasync ddtree63chainasync}; do
        stamp kprof $c
        BENCH_SHAPE=qwen3_8b VLLM_USE_V2_MODEL_RUNNER=1 BENCH_BATCHES=${KPROF_BATCHES:-1,2} \
          BENCH_E2E_BATCHES= BENCH_TPROFILE=1 timeout "$(left ${T_KPROF:-200})" \
          python3 bench/gpu/step_bench.py "$OUT/kprof" "$c" > "$OUT/kprof_$c.txt" 2>&1
        grep -E " N [0-9]+ step ms" "$OUT/kprof_$c.txt" | cut -c1-200
      done
      for n in $(echo ${KPROF_BATCHES:-1,2} | tr , ' '); do
        python3 bench/gpu/kernel_prof.py $(for c in ${KPROF_CONFIGS:-chain15async ddtree64chainasync ddtree63chainasync}; do
          echo "$OUT/kprof/kernels_${c}_N$n.json"; done) > "$OUT/kprof_table_N$n.txt" 2>&1
        head -40 "$OUT/kprof_table_N$n.txt"
      done ;;
    e2e)  # the 27B shape end to end (step_bench.py, BENCH_SHAPE=qwen36_27b): step phases,
      # then tokens/s with the calibrated synthetic drafter; alternating fresh processes,
      # E2E_ROUNDS round ids (spread rounds over calls), E2E_CONFIGS step_bench configs
      for i in ${E2E_ROUNDS:-1}; do
        for c in ${E2E_CONFIGS:-chain15async ddtree16autoasync ddtree16async}; do
          stamp e2e r$i $c
          BENCH_SHAPE=${E2E_SHAPE:-qwen36_27b} VLLM_USE_V2_MODEL_RUNNER=1 BENCH_BATCHES=${E2E_STEP:-1,2} \
            BENCH_E2E_BATCHES=${E2E_BATCHES:-1,2,4,16} BENCH_E2E_ALL=1 \
            timeout "$(left ${T_E2E:-300})" python3 bench/gpu/step_bench.py "$OUT/e2e/r$i" "$c" \
            > "$OUT/e2e_r${i}_$c.txt" 2>&1
          grep -E " N [0-9]+ step ms|e2e" "$OUT/e2e_r${i}_$c.txt" | cut -c1-110
        done
      done ;;
  esac
done
stamp done
(cd "$OUT" && for d in eq_eager eq_graphs eq_bf16 kprof e2e; do [ -d $d ] && tar czf $d.tgz $d && rm -rf $d; done) 2>/dev/null
ls "$OUT"
