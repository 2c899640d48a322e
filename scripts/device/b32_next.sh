#!/usr/bin/env bash
# Issue 40, batch 32 at 68% of the datasheet: the two levers prepared in the ninth session (not yet run
# through the ladder), in one device call from a fresh copy (time limits add up to 540 s):
#   1. the router's choice in the alignment's launch (grouped_moe.ROUTE_IN_ALIGNMENT; tested in Triton's
#      interpreter, compiled for sm90 by scripts/sm90_compile.py, never run on a GPU): -11 launches of a
#      batch-32 step (the router's top-k kernel, now on a tile of tokens, is in the same state);
#   2. the decode attention's wide tier at 16 keys per tile toward 2,560 programs (the bench of
#      runs/examples/h200-issue40-s9/call6: 2.4-3.7% faster per layer at batches 32 and 64).
#
#   bash scripts/device/b32_next.sh
#
# The GPU tests of lever 1 (the batched fp32 parity with vendor-style included), then best-b32-balanced
# through the ladder as committed and with both levers patched in through runpy (the manifest records
# both), each with its profiled step's kernel table: the router + alignment kernels and the attention
# kernel's time apart. Every run is written under $OUT/runs as it finishes.
set -o pipefail
source scripts/device_setup.sh >/dev/null 2>&1
export OUT=${OUT:-device-out}; mkdir -p "$OUT/runs"; R="$OUT/runs"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 180 python3 -m pytest -q tests/test_moe_align.py tests/test_router_triton.py tests/test_variants.py \
    -k "route or align or gpu_batched" -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -n1 "$OUT/gpu_tests.log"
L="measure.kernels=true measure.profile_steps=4 measure.trace=false run.root=$R"
timeout 180 python3 -m harness run +experiment=optimize 'run.only=[best-b32-balanced]' $L run.name=b32-as-is \
    > "$OUT/b32-as-is.log" 2>&1
timeout 180 python3 - > "$OUT/b32-next.log" 2>&1 <<'PY'
import dataclasses, os, runpy, sys
import harness.kernels.decode_attention_triton as d
import harness.variants.grouped_moe as g

g.ROUTE_IN_ALIGNMENT = True                                                              # in the manifest
d.DEFAULT_CONFIG = dataclasses.replace(d.DEFAULT_CONFIG, wide_block_n=16, wide_target_programs=2560)   # too
sys.argv = ["harness", "run", "+experiment=optimize", "run.only=[best-b32-balanced]", "measure.kernels=true",
            "measure.profile_steps=4", "measure.trace=false", f"run.root={os.environ['OUT']}/runs",
            "run.name=b32-next"]
runpy.run_module("harness", run_name="__main__")
PY
for d in "$R"/*-b32-*; do
    python3 runs/examples/h200-b32-align/step_kernels.py "$d" > "$OUT/kernels_$(basename "$d" | cut -d- -f3-).txt" 2>&1
    rm -f "$d/kernels.csv"
done
grep -H "balanced (seed" "$R"/*-b32-*/report.md | grep -v "| – |" | cut -d'|' -f1-2,6-8,15
ls "$OUT" "$R"
