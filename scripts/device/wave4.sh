#!/usr/bin/env bash
# GPU evidence for issue 24 after the flat layout became the fused step's default (2026-11-27), one
# device call per card. Carry .whl. Results under $OUT.
#   bash scripts/device/wave4.sh tests b1 outside      # GPU tests of the fused step; ladder best + best-fused; outside TPOT
#   bash scripts/device/wave4.sh bench                 # bench_decode_step: the fused step (its default tiles)
set -u
set -o pipefail
source scripts/device_setup.sh
OUT=${OUT:-device-out}; mkdir -p "$OUT"
quiet() { grep -v "^USDT\|UserWarning\|_warn_once\|==PROF==\|warnings.warn\|FutureWarning\|repeat [0-9]*/\|warm-up [0-9]" ; }
for section in "$@"; do
  echo "== $section $(date +%T)"; s=$SECONDS
  case $section in
    tests) timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_step.py tests/test_variants.py \
             -k "fused and not vision" 2>&1 | quiet | tail -5 | tee "$OUT/tests.log" ;;
    b1)    timeout 300 python -m harness run +experiment=optimize 'run.only=[best,best-fused]' measure.kernels=true \
             measure.profile_steps=4 measure.trace=false run.root=/tmp/b1 2>&1 | quiet | tail -8 | tee "$OUT/b1.log"
           python scripts/device/headline_keys.py /tmp/b1/*/ 2>/dev/null | tee -a "$OUT/b1.log"
           python scripts/device/step_kernels.py /tmp/b1/*/ --case best-fused > "$OUT/b1_kernels.txt" 2>&1
           for d in /tmp/b1/*/; do (cd "$d" && tar czf "$OUT/b1.tgz" --exclude=traces --exclude=kernels.csv .); done ;;
    outside) ladder_dir=$(ls -d /tmp/b1/*/ 2>/dev/null | head -1)
             timeout 200 python scripts/outside_tpot.py --cases best best-fused ${ladder_dir:+--ladder $ladder_dir} \
               2>&1 | grep -v "UserWarning\|warn" | tail -12 | tee "$OUT/outside.log" ;;
    bench) timeout 300 python scripts/bench_decode_step.py --no-best --no-eager --rounds 3 2>&1 | quiet \
             | tee "$OUT/bench.log" | tail -40 ;;
  esac
  echo "[$section: $((SECONDS - s)) s]" | tee -a "$OUT/times.txt"
done
