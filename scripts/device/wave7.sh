#!/usr/bin/env bash
# GPU evidence for issue 24 after the MoE down kernel's one-wave restructure (2026-11-27), one device
# call per card. Carry .whl, .devstamp (python scripts/device_stamp.py first: the manifests' git
# revision) and the A/B's old kernel file. Results under $OUT. Sections tests, b1,
# outside and bench are wave4.sh's (fused-step GPU tests; ladder best + best-fused; outside TPOT; the
# fused step alone).
#   AB_OLD=.devtmp/ab/decode_step_triton.py AB_CONFIGS="down=(2,8)" \
#     bash scripts/device/wave7.sh ab kernels tests b1 outside bench
# ab:      the fused step (PDL, counted routing, CUDA graph; scripts/device/step_ablation.py
#          --only-configs) with this tree's decode_step_triton.py and with $AB_OLD in its place (an
#          old file must take what this tree's decode_step.py passes: files before 568ce17 lack
#          lm_head_argmax's history and fail),
#          alternating, AB_ROUNDS (3) times each; this tree's also with $AB_CONFIGS (';' within one,
#          ' ' between). ab.log, the means at its end.
# kernels: the Triton kernels' unit tests compiled on the GPU (tests/test_decode_step_triton.py,
#          test_decode_step.py, test_router_triton.py, test_moe_align.py).
# ablate:  scripts/device/step_ablation.py, the step taken apart (ablation.log); stages: its
#          lm_head_stages 0 and 3 (stages.log). (wave6.sh's sections; wave6.sh runs this script.)
set -u
set -o pipefail
OUT=${OUT:-device-out}; mkdir -p "$OUT"
KFILE=src/harness/kernels/decode_step_triton.py
step_us() { timeout 200 python scripts/device/step_ablation.py --only-configs "$@" 2>&1 | grep -v "UserWarning\|warn"; }
for section in "$@"; do
  case $section in
    ab|kernels|ablate|stages) ;;
    *) OUT=$OUT bash scripts/device/wave4.sh "$section"; continue ;;
  esac
  [ -n "${SETUP_DONE:-}" ] || { source scripts/device_setup.sh; SETUP_DONE=1; }
  echo "== $section $(date +%T)"; s=$SECONDS
  case $section in
    ab) [ -f "${AB_OLD:-}" ] || { echo "ab: AB_OLD (the old $KFILE) is not a file" | tee "$OUT/ab.log"; continue; }
        cp "$KFILE" /tmp/ab_new.py
        configs=()
        for c in ${AB_CONFIGS:-}; do configs+=("$c"); done
        step_us ${configs[@]+--configs "${configs[@]}"} | tee "$OUT/ab_configs.log"
        for r in $(seq "${AB_ROUNDS:-3}"); do
          for side in new old; do
            if [ $side = new ]; then cp /tmp/ab_new.py "$KFILE"; else cp "$AB_OLD" "$KFILE"; fi
            us=$(step_us | grep "routing counted" | awk '{for (i = 1; i <= NF; i++) if ($i == "us") print $(i-1)}' | head -1)
            echo "$side ${us:-failed}" | tee -a "$OUT/ab.log"
          done
        done
        cp /tmp/ab_new.py "$KFILE"
        awk '$2 + 0 > 0 {s[$1] += $2; n[$1]++} END {printf "mean new %.1f old %.1f (us per step, %d and %d runs)\n",
             s["new"] / n["new"], s["old"] / n["old"], n["new"], n["old"]}' "$OUT/ab.log" | tee -a "$OUT/ab.log" ;;
    ablate) timeout 300 python scripts/device/step_ablation.py 2>&1 | grep -v "UserWarning\|warn" \
              | tee "$OUT/ablation.log" | tail -40 ;;
    stages) step_us --configs "lm_head_stages=0" "lm_head_stages=3" | tee "$OUT/stages.log" ;;
    kernels) timeout 300 python -m pytest -q -p no:cacheprovider tests/test_decode_step_triton.py tests/test_decode_step.py \
               tests/test_router_triton.py tests/test_moe_align.py 2>&1 | tail -5 | tee "$OUT/kernels.log" ;;
  esac
  echo "[$section: $((SECONDS - s)) s]" | tee -a "$OUT/times.txt"
done
