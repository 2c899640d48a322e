#!/usr/bin/env bash
# Issue 39 item 5 on a 2-GPU H200 host (nvidia-h200-x2; GPUS=all on x4): 620 +- 150 tokens per page,
# balanced routing, batch 128; phase 1 one GPU alone, phase 2 every GPU at once; one run directory under
# $OUT (about 6 minutes). Acceptance: its scaling.csv's speedup (aggregate / one GPU) >= 1.8.
set -u
source scripts/device_setup.sh
OUT=${OUT:-device-out}; mkdir -p "$OUT"
timeout 470 python -m harness run +experiment=throughput throughput.gpus=${GPUS:-2} workload.routing=balanced \
  'throughput.tokens={mean: 620, spread: 150, seed: 0}' 'throughput.batches=[128]' throughput.window_s=20 \
  run.root="$OUT" 2>&1 | grep -v "UserWarning\|warnings.warn" > "$OUT/multi_gpu.log"
rc=${PIPESTATUS[0]}
grep -v "^\[\(alone\|together\)-gpu" "$OUT/multi_gpu.log"; grep "pages/s, " "$OUT/multi_gpu.log"
sed -n '/^| config/,/^$/p' "$OUT"/*-throughput*/throughput.md
exit "$rc"
