#!/usr/bin/env bash
# Device call 2 (and later calls on the same warm machine): install the carried bundle
# parts once, then run_all.sh within the call's time.  Usage (repo root on the device):
#   LIMIT=585 STAGES=... BENCH_CONFIGS=... bash bench/gpu/device_install_and_run.sh
# (call 1 copied .gpu-b1/* to /tmp/vbparts; bench/gpu/pack_calls.sh makes both folders)
set -u
t0=$(date +%s)
if [ ! -d /tmp/vb/vllm_slim ]; then
  [ -d .gpu-b2 ] && cp .gpu-b2/* /tmp/vbparts/
  # pack_calls.sh split part_aa across the two calls
  if [ -f /tmp/vbparts/aa1 ]; then
    cat /tmp/vbparts/aa1 /tmp/vbparts/aa2 > /tmp/vbparts/part_aa && rm /tmp/vbparts/aa1 /tmp/vbparts/aa2
  fi
  SKIP_IMPORT_CHECK=1 bash /tmp/vbparts/install_remote.sh /tmp/vbparts /tmp/vb 2>&1 | tail -4
fi
echo "install: $(($(date +%s) - t0))s"
DEADLINE=$(( ${LIMIT:-585} - ($(date +%s) - t0) )) bash bench/gpu/run_all.sh
