#!/usr/bin/env bash
# GPU batch 5: calibration, the crop_mode experiment (reference, timed), GPU tests, overhead bench.
source scripts/device_setup.sh
python -m harness calibrate run.root=/tmp/cal 2>&1 | grep -v "^USDT" | tail -6
/usr/bin/time -f "crop_mode wall %e s" python -m harness run +experiment=crop_mode run.root=/tmp/runs 2>&1 | grep -v "^USDT" | tail -8
(cd /tmp/runs && tar czf $OUT/crop.tgz --exclude=kernels.csv .)
python -m pytest -q -m gpu tests/ 2>&1 | tail -3
python scripts/bench_overhead.py --rounds 6 2>&1 | grep -v "^USDT\|UserWarning\|_warn_once" | tee $OUT/bench.log
