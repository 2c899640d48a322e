#!/usr/bin/env bash
# Issue 40, "find what makes the two bench paths disagree": three configurations of the fused decode
# step (the defaults; the previous defaults gate_up_chooses=False with router (2, 2); gate_up_chooses=False
# alone, to tell the choice's placement from the router tile) timed as the bench times the step built
# directly, then with each factor of the run path alone, with all, as the bench's harness row times it,
# and through generate() as the ladder times it (harness.bench.decode_step_paths). One GPU call from a
# fresh copy (not yet timed on a GPU: the bench is cut at 225 s); results under $OUT: paths.csv (µs per
# step, measured), report.md (the table and the notes naming the rows under which each configuration's
# order against the defaults reverses), manifest.json, paths.log.
set -o pipefail
source scripts/device_setup.sh
OUT=${OUT:-device-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
rm -rf /tmp/paths
timeout 225 python -m harness bench decode_step \
  'bench.decode_step.match=[cache_len,positions,prompt,history,buffers,events]' \
  "bench.decode_step.configs=['','gate_up_chooses=False;router=(2, 2)','gate_up_chooses=False']" \
  bench.decode_step.rounds=3 run.root=/tmp/paths 2>&1 | grep -v "UserWarning\|warn" | tee "$OUT/paths.log" | tail -45
cp /tmp/paths/*/paths.csv /tmp/paths/*/report.md /tmp/paths/*/manifest.json "$OUT/" 2>/dev/null
ls "$OUT"
