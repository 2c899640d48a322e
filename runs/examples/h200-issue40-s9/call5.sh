#!/bin/bash
# Call 5 of issue 40's ninth session (one H200), the code of call 4: the batch-64 balanced row (its compile
# ran past the eighth session's call) and the batch-1 fused step through the ladder, then best-fused's TPOT
# from outside (generate() of two lengths, synchronised wall clock) against that ladder row.
# Run from the repository root on the device: bash runs/examples/h200-issue40-s9/call5.sh; results in $OUT.
source scripts/device_setup.sh >/dev/null 2>&1; O=${OUT:-/tmp/o}; R=$O/runs; mkdir -p $R; nvidia-smi -L > $O/gpus.txt
timeout 300 python3 -m harness run +experiment=optimize 'run.only=[best-b64-balanced,best-fused]' \
    measure.kernels=true measure.profile_steps=4 measure.trace=false run.root=$R run.name=ladder > $O/ladder.log 2>&1
d=$(ls -d $R/*-ladder); python3 runs/examples/h200-b32-align/step_kernels.py $d > $O/kernels_ladder.txt 2>&1
rm -f $d/kernels.csv
grep -h "^| best-b64-balanced\|^| best-fused " $d/report.md | grep "(seed\|weights" | cut -d'|' -f1-2,6-8,15
timeout 150 python3 -m harness bench outside_tpot 'bench.outside_tpot.executions=[best-fused]' \
    bench.outside_tpot.ladder=$d run.root=$R run.name=outside > $O/outside.log 2>&1
grep -i "tpot\|within\|differ" $O/outside.log | tail -6
tail -qn1 $O/*.log
