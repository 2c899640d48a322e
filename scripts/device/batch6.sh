#!/usr/bin/env bash
# GPU batch 6: crop_mode (reference, timed) and ncu over decode (DRAM bytes, 1 decode step).
source scripts/device_setup.sh
export PATH=$PATH:/usr/local/cuda/bin
python -m harness calibrate run.root=/tmp/cal 2>&1 | grep "GEMM\|copy " | head -2
/usr/bin/time -f "crop_mode wall %e s" python -m harness run +experiment=crop_mode run.root=/tmp/runs 2>&1 | grep -v "^USDT" | grep "wall\|wrote\|built\|profiled" 
(cd /tmp/runs && tar czf $OUT/crop.tgz --exclude=kernels.csv .)
timeout 300 python -m harness profile tool=ncu stage=decode profile.metrics=memory workload.decode_tokens=2 run.root=/tmp/prof 2>&1 | grep -v "^USDT\|==PROF==" | tail -25
(cd /tmp/prof && tar czf $OUT/prof.tgz --exclude='*.ncu-rep' --exclude='*.hydra*' --exclude='kernels_raw.csv' .)
