#!/usr/bin/env bash
# The GPU acceptance steps, as run on the lent H100 (one or more sections per call; results under
# $OUT when set, else ./device-out). Carry .whl (and .whl-vendor + models for `vendor`).
#   bash scripts/device/acceptance.sh calibrate run crop bench
#   bash scripts/device/acceptance.sh vendor vrun ncu cv probe host settle
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
    calibrate) python -m harness calibrate run.root=/tmp/cal 2>&1 | quiet | tail -9 ;;
    run)       python -m harness run measure.kernels=true run.root=/tmp/acc run.name=acceptance 2>&1 | quiet | tee "$OUT/run.log"
               python scripts/device/cv_table.py /tmp/acc/*-acceptance/ | tee -a "$OUT/run.log"
               (cd /tmp/acc && tar czf "$OUT/acceptance.tgz" --exclude=kernels.csv .) ;;
    crop)      /usr/bin/time -f "crop_mode wall %e s" python -m harness run +experiment=crop_mode run.root=/tmp/runs 2>&1 | quiet | tail -4
               (cd /tmp/runs && tar czf "$OUT/runs.tgz" --exclude=kernels.csv .) ;;
    vendor)    (vendor_env; /usr/bin/time -f "vendor crop_mode wall %e s" python -m harness run model=vendor model.trust_remote_code=true +experiment=crop_mode \
                  run.root=/tmp/vruns 2>&1 | quiet | grep -v "transitioning" | tail -4)
               (cd /tmp/vruns && tar czf "$OUT/vendor.tgz" --exclude=kernels.csv .) ;;
    tests)     python -m pytest -q -m gpu tests/ 2>&1 | tail -3 ;;
    bench)     python -m harness bench overhead bench.overhead.rounds=${ROUNDS:-40} bench.overhead.capture_rounds=${CROUNDS:-8} \
                 run.root=/tmp/bench 2>&1 | quiet | tee "$OUT/bench.log"; cp /tmp/bench/*-bench-overhead/report.md "$OUT/bench.md" ;;
    ncu)       python -m harness profile tool=ncu stage=sam run.root=/tmp/prof 2>&1 | quiet | tail -12
               python -m harness profile tool=ncu stage=decode profile.metrics=memory workload.decode_tokens=2 \
                 run.root=/tmp/prof 2>&1 | quiet | tail -12
               (cd /tmp/prof && tar czf "$OUT/prof.tgz" --exclude='*.ncu-rep' --exclude='kernels_raw.csv' .) ;;
    cv)        python -m harness run measure.repeats=10 run.root=/tmp/cv run.name=cv10 2>&1 | grep wrote
               python scripts/device/cv_table.py /tmp/cv/*-cv10/ | tee "$OUT/cv.log" ;;
    vrun)      (vendor_env; python -m harness run model=vendor model.trust_remote_code=true measure.kernels=true measure.repeats=3 run.root=/tmp/vacc \
                  run.name=vendor 2>&1 | quiet | grep -v "transitioning" | tail -3
                python scripts/device/cv_table.py /tmp/vacc/*-vendor/ | tee "$OUT/vendor.log") ;;
    probe)     ncu --nvtx --nvtx-include "harness@request/sam/" --clock-control none \
                 --metrics sm__ops_path_tensor_src_bf16_dst_fp32.sum,dram__bytes_read.sum --csv --page raw \
                 --print-units base python scripts/device/ncu_probe.py 2>/dev/null | tail -2 | cut -c1-300 ;;
    host)      python -m harness bench host_noise run.root=/tmp/host 2>&1 | tee "$OUT/host.log"
               cp /tmp/host/*-bench-host_noise/report.md "$OUT/host.md" ;;
    settle)    for ms in 0 100; do   # stage CV without / with GPU settling; same seeds, so same inputs per repeat
                 python -m harness run measure.repeats=10 measure.settle_ms=$ms run.root=/tmp/settle$ms \
                   run.name=settle$ms 2>&1 | grep wrote
                 python scripts/device/cv_table.py /tmp/settle$ms/*-settle$ms/ | tee -a "$OUT/settle.log"
               done ;;
    *)         echo "unknown section $section" ;;
  esac
done
