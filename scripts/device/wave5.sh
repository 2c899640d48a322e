#!/usr/bin/env bash
# GPU evidence for issue 24's batched decode (2026-11-27), one device call per card. Carry .whl. Results under $OUT.
#   bash scripts/device/wave5.sh b32k attn moe  # b32 balanced ladder row + its step's kernels; attention, MoE tiles
#   bash scripts/device/wave5.sh tests b32 b8    # GPU tests of the batched router / alignment; ladder, both routings
#   bash scripts/device/wave5.sh b64 tp128       # batch 64 rows; pages/s at batch 128, balanced, 620 +- 150 tokens
set -u
set -o pipefail
source scripts/device_setup.sh
OUT=${OUT:-device-out}; mkdir -p "$OUT"
quiet() { grep -v "^USDT\|UserWarning\|_warn_once\|==PROF==\|warnings.warn\|FutureWarning\|repeat [0-9]*/" ; }
ladder() {  # ladder NAME CASES...: the optimize experiment's rows, kernels profiled; report + step kernels to $OUT/NAME
  name=$1; shift; cases=$(IFS=,; echo "$*")
  timeout 400 python -m harness run +experiment=optimize "run.only=[$cases]" measure.kernels=true \
    measure.profile_steps=4 measure.trace=false run.root=/tmp/$name 2>&1 | quiet | tail -6 | tee "$OUT/$name.log"
  python scripts/device/headline_keys.py /tmp/$name/*/ 2>/dev/null | tee -a "$OUT/$name.log"
  python scripts/device/step_kernels.py /tmp/$name/*/ > "$OUT/${name}_kernels.txt"
  for d in /tmp/$name/*/; do (cd "$d" && tar czf "$OUT/$name.tgz" --exclude=traces --exclude=kernels.csv .); done
}
for section in "$@"; do
  echo "== $section $(date +%T)"; s=$SECONDS
  case $section in
    tests) timeout 300 python -m pytest -q -p no:cacheprovider --tb=short -W ignore -m gpu tests/test_moe_align.py \
             tests/test_router_triton.py tests/test_fast_moe.py tests/test_variants.py \
             -k "align or route or batched or sync_free" > "$OUT/tests.log" 2>&1; tail -30 "$OUT/tests.log" ;;
    b32k) ladder b32k best-b32-balanced ;;
    b32)  ladder b32 best-b32-balanced best-b32 ;;
    b8)   ladder b8 best-b8-balanced best-b8 ;;
    b64)  ladder b64 best-b64-balanced best-b64 ;;
    tp128) timeout 500 python -m harness run +experiment=throughput \
             'throughput.tokens={mean: 620, spread: 150, seed: 0}' workload.routing=balanced \
             'throughput.batches=[128]' run.root=/tmp/tp128 2>&1 | quiet | tail -12 \
             | tee "$OUT/tp128.log"
           for d in /tmp/tp128/*/; do (cd "$d" && tar czf "$OUT/tp128.tgz" --exclude=traces .); done ;;
    b1)   ladder b1 best-fused ;;
    attn) timeout 200 python scripts/bench_decode_attention.py --batch 8 32 --sweep --len 512 --pos 413 2>&1 | quiet \
            | tee "$OUT/attn.log" | tail -30 ;;
    moe)  timeout 300 python scripts/bench_fast_moe.py --blocks-sweep --tokens 32 --reps 30 2>&1 | quiet \
            | tee "$OUT/moe.log" | tail -15 ;;
  esac
  echo "[$section: $((SECONDS - s)) s]" | tee -a "$OUT/times.txt"
done
