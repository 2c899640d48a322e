#!/usr/bin/env bash
# GPU batch 4: per-range cost, ncu over sam and decode (reference, base), nsys attempt.
source scripts/device_setup.sh
export PATH=$PATH:$(dirname $(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1) 2>/dev/null)
python scripts/device/range_cost.py 2>&1 | tail -2 | tee $OUT/range_cost.log
for st in sam decode; do
  timeout 280 python -m harness profile tool=ncu stage=$st workload.decode_tokens=3 run.root=/tmp/prof 2>&1 | grep -v "^USDT\|==PROF==" | tail -30
done
timeout 120 python -m harness profile tool=nsys stage=decode run.root=/tmp/prof 2>&1 | tail -2
(cd /tmp/prof && tar czf $OUT/prof.tgz --exclude='*.ncu-rep' --exclude='*.hydra*' --exclude='kernels_raw.csv' .)
