#!/usr/bin/env bash
# First look at the execution variants on a GPU (one call): GPU tests of the variants and kernels,
# the MoE and SAM-attention micro-benchmarks, and a short optimize ladder. Results under $OUT.
set -o pipefail
source scripts/device_setup.sh
OUT=${OUT:-device-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
t() { local s=$SECONDS; "$@"; echo "[$((SECONDS - s)) s] $*" >> "$OUT/times.txt"; }
t timeout 200 python -m pytest -q -m gpu -x -p no:cacheprovider tests/test_variants.py tests/test_fast_moe.py \
  tests/test_sam_attention.py 2>&1 | tail -15 | tee "$OUT/gputests.log"
t timeout 100 python -m harness bench moe 'bench.moe.tokens=[1,8,32,64,300]' bench.moe.reps=50 bench.moe.fp32=false \
  run.root=/tmp/bench 2>&1 | tail -30 | tee "$OUT/bench_moe.log"
t timeout 120 python -m harness bench sam_attention bench.sam_attention.triton=true \
  'bench.sam_attention.cases=[base_global,large_global,base_window]' bench.sam_attention.reps=30 run.root=/tmp/bench \
  2>&1 | tail -30 | tee "$OUT/bench_sam.log"
t timeout 300 python -m harness run +experiment=optimize measure.repeats=3 measure.warmup=1 run.root=/tmp/opt \
  2>&1 | grep -v "UserWarning\|warn" | tail -25 | tee "$OUT/opt.log"
(cd /tmp/opt && tar czf "$OUT/opt.tgz" --exclude=kernels.csv .)
cat "$OUT/times.txt"
