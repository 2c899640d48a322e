#!/usr/bin/env bash
# GPU evidence still owed by issues 22, 24, 25 and 26 after the 2026-11-26 session, one section per
# device call (each fits the 600 s limit on an H100; the ladder's batch sizes compile ~55 s each, so
# they are split). Carry .whl. Results under $OUT (one tarball per run folder with kernels.csv, no traces).
#   bash scripts/device/wave3.sh routing8          # batch-8 per-step routing counts under a captured step (~60 s)
#   bash scripts/device/wave3.sh b1                # vendor-style, best, best-balanced, best-fused (~250 s)
#   bash scripts/device/wave3.sh b8 | b32 | b64    # best-bN and best-bN-balanced (~150-250 s each)
#   bash scripts/device/wave3.sh ncu8 outside crop # ncu DRAM reads at b8; outside TPOT; crop_mode wall time
#   bash scripts/device/wave3.sh tp tp620          # throughput, 512 tokens / the 620-token draw, both routings
set -u
set -o pipefail
source scripts/device_setup.sh
OUT=${OUT:-device-out}; mkdir -p "$OUT"
quiet() { grep -v "^USDT\|UserWarning\|_warn_once\|==PROF==\|warnings.warn\|FutureWarning\|repeat [0-9]*/\|warm-up [0-9]" ; }
pack() { for d in "$1"/*/; do [ -d "$d" ] && (cd "$d" && tar czf "$OUT/$2.tgz" --exclude=traces \
          --exclude='*.ncu-rep' --exclude='*.nsys-rep' .); done; true; }   # kernels.csv kept: `harness merge` needs it
ladder() {   # ladder LABEL CASES SECONDS
  timeout "$3" python -m harness run +experiment=optimize run.only=["$2"] measure.kernels=true measure.profile_steps=4 \
    measure.trace=false run.root=/tmp/$1 2>&1 | quiet | tail -8 | tee "$OUT/$1.log"
  python scripts/device/headline_keys.py /tmp/$1/*/ 2>/dev/null | tee -a "$OUT/$1.log"; pack /tmp/$1 "$1"
}
EX8='{kv_cache: static, moe_impl: grouped, cuda_graphs: decode}'
for section in "$@"; do
  echo "== $section $(date +%T)"; s=$SECONDS
  case $section in
    routing8) timeout 120 python -m harness run "cases=[{name: g8, batch: 8, execution: $EX8}, {name: g8-balanced, batch: 8, \
                routing: balanced, execution: $EX8}]" workload.decode_tokens=16 measure.repeats=2 measure.warmup=1 \
                hardware.calibrate=false run.root=/tmp/routing8 2>&1 | quiet | tail -3 | tee "$OUT/routing8.log"
              python - /tmp/routing8/*/routing_steps.csv <<'PY' | tee -a "$OUT/routing8.log"
import sys, pandas as pd
r = pd.read_csv(sys.argv[1]); e = [c for c in r.columns if c[0] == "e" and c[1:].isdigit()]
for case, g in r.groupby("case"):   # every (step, layer) must sum to 8 rows x top-6 = 48
    print(case, "sums", sorted(g[e].sum(axis=1).unique().tolist()), "experts/step median", g.experts.median())
PY
              ;;
    b1)   ladder b1 vendor-style,best,best-balanced,best-fused 400 ;;
    b8)   ladder b8 best-b8,best-b8-balanced 400 ;;
    b32)  ladder b32 best-b32,best-b32-balanced 450 ;;
    b64)  ladder b64 best-b64,best-b64-balanced 500 ;;
    ncu8) timeout 400 python -m harness profile tool=ncu stage=decode profile.metrics=memory workload.decode_tokens=4 \
            workload.batch=8 execution.kv_cache=static execution.moe_impl=grouped run.root=/tmp/ncu8 2>&1 | quiet \
            | tail -20 | tee "$OUT/ncu8.log"; pack /tmp/ncu8 ncu8 ;;
    outside) ladder_dir=$(ls -d /tmp/b1/*/ 2>/dev/null | head -1)   # the b1 section's run, when this call ran it
             timeout 300 python scripts/outside_tpot.py --cases best best-fused best-balanced ${ladder_dir:+--ladder $ladder_dir} \
               2>&1 | quiet | tail -20 | tee "$OUT/outside.log" ;;
    crop) /usr/bin/time -f "crop_mode wall %e s" timeout 300 python -m harness run +experiment=crop_mode run.root=/tmp/crop \
            2>&1 | quiet | tail -4 | tee "$OUT/crop.log"; pack /tmp/crop crop ;;
    tp|tp-balanced|tp-weights)   # tp: both routings (~600 s: two calls are safer); tp-<routing>: one
          for routing in $( [ $section = tp ] && echo balanced weights || echo ${section#tp-} ); do
            timeout 450 python -m harness run +experiment=throughput workload.decode_tokens=512 workload.routing=$routing \
              run.root=/tmp/tp-$routing 2>&1 | quiet | tail -6 | tee -a "$OUT/tp.log"; pack /tmp/tp-$routing tp-$routing
          done ;;
    tp620) timeout 500 python -m harness run +experiment=throughput 'throughput.tokens={mean: 620, spread: 150, seed: 0}' \
             workload.routing=balanced run.root=/tmp/tp620 2>&1 | quiet | tail -6 | tee "$OUT/tp620.log"
           pack /tmp/tp620 tp620 ;;
  esac
  echo "[$section: $((SECONDS - s)) s]" | tee -a "$OUT/times.txt"
done
