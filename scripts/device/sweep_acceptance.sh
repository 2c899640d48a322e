#!/usr/bin/env bash
# Issue 16 on a GPU node: the 4-run joblib sweep on two GPUs and pinned to one, and nsys over the
# harness's stages. Carry .whl (scripts/device_wheels.sh: it includes the sweep extra) and, for
# nsys, .nsysdeps/ (scripts/fetch_nsys_libs.sh). Results under $OUT (default ./device-out).
#
#   bash scripts/device/sweep_acceptance.sh sweep2 sweep1 summarize   # 2-GPU machine, same warm node
#   bash scripts/device/sweep_acceptance.sh nsys                      # any GPU machine
#
# EXTRA="model=tiny ..." adds overrides (a dry run on a CPU machine: EXTRA="model=tiny device=cpu ...").
# One-liner for nsys alone (the importer's libdw/libelf come from .nsysdeps/root):
#   HARNESS_NSYS_LIBS=.nsysdeps/root python -m harness profile tool=nsys stage=decode run.root=/tmp/nsys
set -u
source scripts/device_setup.sh
OUT=${OUT:-device-out}; mkdir -p "$OUT"
ROOT=${ROOT:-/tmp/sweep}
SWEEP=(-m hydra/launcher=gpus workload.decode_tokens=32,64,96,128 measure.warmup=1 measure.repeats=${REPEATS:-3} ${EXTRA:-})

now() { python3 -c 'import time; print(f"{time.time():.3f}")'; }

# jobs of one sweep: job, slot, CUDA_VISIBLE_DEVICES, pid, start/end (s after the first start)
jobs() {
  python3 - "$1" <<'EOF'
import json, sys
from pathlib import Path
sweeps = sorted(Path(sys.argv[1]).glob("multirun-*"))
recs = {d.name: json.loads((d / "sweep_job.json").read_text()) for d in sorted(sweeps[-1].iterdir())
        if (d / "sweep_job.json").is_file()} if sweeps else {}
if not recs:
    sys.exit(f"  no job records (sweep_job.json) under {sys.argv[1]}")
t0 = min(r["start_unix"] for r in recs.values())
for name, r in recs.items():
    print(f"  job {name:>8}  slot {r['slot']}  CUDA_VISIBLE_DEVICES={r['CUDA_VISIBLE_DEVICES']}  pid {r['pid']}  "
          f"{r['start_unix'] - t0:7.1f} s -> {r.get('end_unix', float('nan')) - t0:7.1f} s  {r.get('hydra_status')}")
print(f"  {sweeps[-1]}")
EOF
}

# one sweep with the GPUs in $1 (CUDA_VISIBLE_DEVICES); nvidia-smi samples memory and utilisation meanwhile
sweep() {
  local label=$1 gpus=$2
  rm -rf "$ROOT/$label"
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader -lms 500 \
    > "$OUT/$label-smi.csv" 2>/dev/null & local smi=$!
  local t0; t0=$(now)
  CUDA_VISIBLE_DEVICES=$gpus python -m harness run "${SWEEP[@]}" run.root="$ROOT/$label" run.name="$label" \
    > "$OUT/$label.log" 2>&1
  local rc=$? t1; t1=$(now)
  kill $smi 2>/dev/null
  grep -E "^\[harness\] (sweep|job)|^error" "$OUT/$label.log"
  echo "$label (CUDA_VISIBLE_DEVICES=$gpus): exit $rc, wall $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
  jobs "$ROOT/$label"
  python3 - "$OUT/$label-smi.csv" <<'EOF'
import csv, sys
peak = {}
for row in csv.reader(open(sys.argv[1])):
    if len(row) < 4:
        continue
    gpu, util, mem = row[1].strip(), row[2].strip().split()[0], row[3].strip().split()[0]
    if util.isdigit() and mem.isdigit():
        u, m = peak.get(gpu, (0, 0))
        peak[gpu] = (max(u, int(util)), max(m, int(mem)))
print("  nvidia-smi peaks: " + ", ".join(f"GPU {g}: {u}% util, {m} MiB" for g, (u, m) in sorted(peak.items())))
EOF
}

for section in "$@"; do
  echo "== $section"
  case $section in
    sweep2)    sweep gpus2 "${GPUS2:-0,1}" ;;
    sweep1)    sweep gpus1 "${GPUS1:-0}" ;;
    summarize) for label in gpus2 gpus1; do
                 d=$(ls -d "$ROOT/$label"/multirun-* 2>/dev/null | tail -1)
                 [ -n "$d" ] || { echo "no $label sweep under $ROOT"; continue; }
                 python -m harness summarize "$d" 2>&1 | grep -v "^\[harness\] wrote" | tee "$OUT/summary-$label.md" | head -30
               done
               (cd "$ROOT" && tar czf "$OUT/sweeps.tgz" --exclude=kernels.csv --exclude='*.png' .) ;;
    nsys)      python -m harness profile tool=nsys stage=decode run.root=/tmp/nsys 2>&1 \
                 | grep -v "^USDT\|UserWarning\|_warn_once" | tail -40 | tee "$OUT/nsys.log"
               (cd /tmp/nsys && tar czf "$OUT/nsys.tgz" --exclude='*.nsys-rep' --exclude='*.sqlite' --exclude='*.qdstrm' .) ;;
    *)         echo "unknown section $section (sweep2 sweep1 summarize nsys)" ;;
  esac
done
