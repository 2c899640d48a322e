#!/usr/bin/env bash
# The GPU acceptance steps, as run on the lent H100 (one or more sections per call; results under
# $OUT when set, else ./device-out). Carry .whl (and .whl-vendor + models for `vendor`).
#   bash scripts/device/acceptance.sh calibrate run crop bench
#   bash scripts/device/acceptance.sh vendor ncu cv probe
set -u
source scripts/device_setup.sh
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-device-out}; mkdir -p "$OUT"
quiet() { grep -v "^USDT\|UserWarning\|_warn_once\|==PROF==" ; }
vendor_env() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .whl-vendor/*.whl
  export PYTHONPATH=/tmp/vsite:$PYTHONPATH
}
for section in "$@"; do
  echo "== $section"
  case $section in
    calibrate) python -m harness calibrate run.root=/tmp/cal 2>&1 | quiet | tail -6 ;;
    run)       python -m harness run measure.kernels=true run.root=/tmp/runs 2>&1 | quiet | tee "$OUT/run.log" ;;
    crop)      /usr/bin/time -f "crop_mode wall %e s" python -m harness run +experiment=crop_mode run.root=/tmp/runs 2>&1 | quiet | tail -4
               (cd /tmp/runs && tar czf "$OUT/runs.tgz" --exclude=kernels.csv .) ;;
    vendor)    (vendor_env; /usr/bin/time -f "vendor crop_mode wall %e s" python -m harness run model=vendor +experiment=crop_mode \
                  run.root=/tmp/vruns 2>&1 | quiet | grep -v "transitioning" | tail -4)
               (cd /tmp/vruns && tar czf "$OUT/vendor.tgz" --exclude=kernels.csv .) ;;
    tests)     python -m pytest -q -m gpu tests/ 2>&1 | tail -3 ;;
    bench)     python scripts/bench_overhead.py --rounds 6 2>&1 | quiet | tee "$OUT/bench.log"
               python scripts/device/range_cost.py 2>&1 | tail -1 | tee -a "$OUT/bench.log" ;;
    ncu)       python -m harness profile tool=ncu stage=sam run.root=/tmp/prof 2>&1 | quiet | tail -12
               python -m harness profile tool=ncu stage=decode profile.metrics=memory workload.decode_tokens=2 \
                 run.root=/tmp/prof 2>&1 | quiet | tail -12
               (cd /tmp/prof && tar czf "$OUT/prof.tgz" --exclude='*.ncu-rep' --exclude='kernels_raw.csv' .) ;;
    cv)        taskset -c 2-5 python -m harness run measure.repeats=10 measure.warmup=2 run.root=/tmp/cv 2>&1 | grep wrote ;;
    probe)     ncu --nvtx --nvtx-include "harness@request/sam/" --clock-control none \
                 --metrics sm__ops_path_tensor_src_bf16_dst_fp32.sum,dram__bytes_read.sum --csv --page raw \
                 --print-units base python scripts/device/ncu_probe.py 2>/dev/null | tail -2 | cut -c1-300 ;;
    *)         echo "unknown section $section" ;;
  esac
done
