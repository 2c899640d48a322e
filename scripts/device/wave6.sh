#!/usr/bin/env bash
# GPU evidence for issue 24 after lm_head's pipelined loop and the routing count at the step end
# (2026-11-27), one device call per card. Carry .whl. Results under $OUT. Sections tests, b1, outside
# and bench are wave4.sh's (GPU tests; ladder best + best-fused; outside TPOT; the fused step alone).
#   bash scripts/device/wave6.sh tests b1 outside bench ablate   # ... and the step taken apart (H200)
#   bash scripts/device/wave6.sh b1 outside bench stages tests   # ... and lm_head_stages 0 / 3 (H100)
set -u
set -o pipefail
OUT=${OUT:-device-out}; mkdir -p "$OUT"
for section in "$@"; do
  case $section in
    ablate|stages) ;;
    *) OUT=$OUT bash scripts/device/wave4.sh "$section"; continue ;;
  esac
  [ -n "${SETUP_DONE:-}" ] || { source scripts/device_setup.sh; SETUP_DONE=1; }
  echo "== $section $(date +%T)"; s=$SECONDS
  case $section in
    ablate) timeout 300 python scripts/device/step_ablation.py 2>&1 | grep -v "UserWarning\|warn" \
              | tee "$OUT/ablation.log" | tail -40 ;;
    stages) timeout 300 python scripts/device/step_ablation.py --only-configs --configs "lm_head_stages=0" \
              "lm_head_stages=3" 2>&1 | grep -v "UserWarning\|warn" | tee "$OUT/stages.log" ;;
  esac
  echo "[$section: $((SECONDS - s)) s]" | tee -a "$OUT/times.txt"
done
