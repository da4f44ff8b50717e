#!/usr/bin/env bash
# The GDN-on-CUDA session on the H200 (issue 27), run as a user would: the stock slim
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
# structured-output masks, #32), e2e (27B-shape step phases and end-to-end
# tokens/s, step_bench.py; not run yet).  VERIFY=0: apply without `verify`.
# Everything writes under $OUT; EQ_ROWS / EQG_ROWS pick rows (IEEE_ROWS: fp32ieee's extra
# row flags, default "--features-row --grammar-row --json-row").
# A fresh machine compiles vLLM's Triton kernels at its first engine start (~150 s for
# the tiny hybrid): run `apply` with verify (it starts that engine) before eq / step, or
# give the first engine stage that time (run 14's eq and step calls timed out on it).
# A session's plan (30 min): b1; install apply tests (verify on); eqg eq; step bench.
# Run 18 (H200) ran fp32ieee, profile, e2e round 1 and 0.32.0's verify; its profile found
# the per-layer GDN plan, fixed after it.  Next: b1; install apply (VERIFY=0) profile
# (PROFILE_CONFIGS="ddtreechain dflash": the plan's ~2,550 small kernels a step should be
# gone); e2e rounds 1-3 (E2E_ROUNDS, spread over calls); eqg + chisq (the GDN path after
# the change: the commit kernel now sums the path by one dot); fp32ieee (now also the
# grammar row: V2 structured outputs, bad words, min_p; prepared, never run).
# Run 19 (H100) did b1; install apply profile; e2e rounds 1-3; eqg + chisq; tests.
# Next (H200): b1; install apply (VERIFY=0); fp32ieee (the grammar row, #32) and fp32
# (V1 rows, #28); e2e at BENCH_E2E_NEW=256 (3 rounds: does p90 at 1-2 requests hold with
# the first step weighing half as much?), with E2E_CONFIGS adding ddtree15autoasync (a
# tree step of 16 rows, the chain's own M: run 19's tree step of 17 rows cost 0.7 ms
# more than its chain step at 1 request); startup (#29: STARTUP_FRESH=1
# STARTUP_SEQS=1,8 then 64 then 256, rounds spread over calls).
# Run 20 (H100) did b1; install apply fp32ieee (the grammar row died: the bundle lacks
# lm-format-enforcer, which 0.33 imports to validate any structured request; .whl now
# carries it: bench/gpu/make_whl.sh); fp32; startup x2; e2e round 1 at 256 tokens.
# Next: b1 (after `bash bench/gpu/make_whl.sh`); install apply (VERIFY=0) fp32ieee
# (EQ rows are quick: the grammar row is what is new); profile with PROFILE_FIRST=1
# PROFILE_CONFIGS="dflash ddtree16" (run 20: DDTree's first step 186 vs 160 ms on average,
# what keeps p90 at 1-2 requests under 1.00); e2e rounds 2-3 at 256 tokens
# (BENCH_E2E_NEW=256 E2E_BATCHES=1,2,4 E2E_CONFIGS="chain15async ddtree15autoasync
# ddtree16autoasync ddtree16async": the fixed tree too, for the choice's 2 % target);
# grammar (the mask cost with the serving box's 16 CPUs: xgrammar's batch fill on 8 threads).
# Run 21 (H100) did all of that (grammar row 8/8; e2e rounds 2-3; startup round 2); the
# choice changed after it (a close call goes to the tree).  Next: b1; install apply
# (VERIFY=0); e2e rounds 1-3 at 256 tokens with E2E_CONFIGS="chain15async
# ddtree16autoasync ddtree16async" (does the new choice come within 2 % of the fixed tree?),
# then the 8B shape the same way (E2E_SHAPE=qwen3_8b: #29's own shape); fp32ieee once
# (its new JSON row, #32: JSON schemas with a byte-level BPE tokenizer, never run on a GPU).
# Run 22 (H100; 8 minutes, no machine for an hour) did b1; install apply fp32ieee
# (IEEE_ROWS="--json-row --grammar-row": JSON 8/8); e2e round 1 with chain15async and
# ddtree16everyasync (the arms at every batch size: 1.18 / 1.04 / 1.03 at 4 requests).
# Next: b1; install apply (VERIFY=0); e2e rounds 1-3, E2E_CONFIGS="chain15async
# ddtree16autoasync ddtree16async ddtree16everyasync" (same-call: the choice vs the fixed
# tree, and the arms everywhere); startup with a schedule of [[1, 65536, 16]] at
# max_num_seqs 16 (the cost of both arms' graphs); #31: bench/realpair/run.sh STAGES=trainbg
# in call 1 (it shares the GPU: only installs / equality beside it), "wait measure" later.
# The realpair session (H100, 25 GPU minutes; bench/RESULTS.md "#31: a pair trained on the
# H100") did b1 + trainbg x2; install apply; wait; the A2 pair + measure: chain tau 3.79 as
# a decode, but in vLLM (V1, eager, bf16) trees of 64 / 256 lose depth (0.67 / 0.58 of
# offline; chain 0.95).  Next (one warm machine): b1 + trainbg (one run, the A recipe:
# TARGET_SECONDS=180 GEN_SECONDS=80 DRAFTER_SECONDS=480, TRAIN_ARGS="--set gen_batch=1536
# --set gen_max_seqs=36864 --set d_layers=3 --set budgets=[8,16,32,64,128,256]"); install
# apply; "wait measure" with CONFIGS=nospec,chain,ddtree16,ddtree64,ddtree256 (now with
# no-spec's gaps: near-ties or not): does the commit fix (every tree row back on its
# linear position; the depth loss's cause, found on the CPU after the run) bring vLLM's
# tau at B = 64 / 256 to the offline decode's?  check_vllm.py --method ddtree --budget 256
# (the drafter's calls vs the offline recomputation), and measure again with
# VLLM_USE_V2_MODEL_RUNNER=1 (users' default, never affected) and without --eager.
# #31's 8B-shape row with the measured profile: e2e with E2E_SHAPE=qwen3_8b
# BENCH_PROFILES=p60,p80,p90,real BENCH_REAL_PROFILE=bench/gpu/profiles/realpair_h100_1.json
# (3 rounds, chain vs the default, an H200 if one comes).
# The realpair_h100_2 session (H100, 25 GPU minutes) did all of that but the V2 fp32 rows:
# trainbg (300 s drafter); install apply; wait measure V1 (tau == offline now), V2 measure;
# e2e 8B x 4 rounds with E2E_CONFIGS="chain15async ddtree64autoasync ddtree64chainasync"
# (read with bench/gpu/e2e_logs.py); check_vllm fp32.  Changed after it, never run on a
# GPU: the choice's paired counts in two Triton launches (core/paired_counts.py) and a
# clear tree lead exploring the chain rarely.  Next: b1; install apply (verify --quick's
# kernel check now runs the paired counts on CUDA) and `pytest tests/gpu/test_paired_counts.py
# tests/gpu/test_arms.py` on CUDA; the same 8B e2e, 3-4 rounds, E2E_CONFIGS="chain15async
# ddtree64autoasync ddtree64chainasync" (does p60 / 1 request reach 0.98 of the fixed
# tree?); DDTree's V2 host time on a tiny target (a step 6 ms vs the chain's 2.3 ms, no
# async; realpair's measure, V2): profile it; the V2 fp32 rows (fp32ieee).
# The session after it got one H100 call in six tries (call 1 + `python3
# bench/gpu/gemm_by_m.py $OUT/gemm`: 65 rows 1.026x the chain's 16, 64 rows 1.010x);
# the machine was taken back during call 2.  Still to run: call 2: install apply
# (VERIFY=0), `verify --quick`,
# pytest tests/gpu/test_paired_counts.py tests/gpu/test_arms.py, then STAGES=kprof (chain15async
# ddtree64chainasync ddtree63chainasync: the step by kernel category, kernel_prof.py);
# then e2e rounds with E2E_CONFIGS="chain15async ddtree64autoasync ddtree64autoktasync
# ddtree64chainasync" (kt: the choice keeps its step times across cells, as a server does)
# and ddtree63autoasync (1 + B on 64 rows: B = 63 / 31 at 1 / 2 requests).
# Stop 47 got no machine (10 tries; the failed starts spent 5/6 of the device time).  The
# same plan stands; with little device time, call 2 alone (install apply, then pytest
# tests/gpu/test_paired_counts.py tests/gpu/test_arms.py, ~4 minutes) is the first
# thing worth having, kprof (KPROF_CONFIGS="chain15async ddtree64chainasync") the second.
# Run 23 (H100, the machine at the first try) did b1; install apply, verify --quick, the
# paired-count GPU tests (45 passed); kprof chain / B = 64 / B = 63; e2e 3 rounds with
# "chain15async ddtree64autoasync ddtree64autoktasync ddtree64chainasync", then with
# "chain15async ddtree63autoasync ddtree63chainasync"; startup 1 / 8 / 64.  B = 63 won
# every cell at 1-2 requests: the V2 default is now 63 at 1 and 2 requests for B = 64
# (so ddtree64auto* means 63 / 63 from here on).  Next: b1; install apply (VERIFY=0);
# e2e 3 rounds, E2E_CONFIGS="chain15async ddtree64autoasync ddtree64autoktasync
# ddtree63chainasync" (the new default with the choice against its fixed tree); the
# tree attention sweep at 1-2 requests (`SWEEP_SHAPES=1x63,2x63 SWEEP_BUDGET_S=200
# python3 bench/gpu/attn_sweep.py $OUT/sweep`: +0.54 ms a step against FA3 at 1 request
# is the largest piece left; its TUNING table was swept on an H200 for 65 rows);
# startup at 256; the V2 fp32 rows (fp32ieee) with the new default.
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
