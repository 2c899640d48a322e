#!/bin/bash
# Call 3 of issue 40's eighth session (one H200): best-b32-balanced and best-b64-balanced with the decode
# attention's new wide tier (the default), the pipeline at batch 128 and 620 +- 150 tokens, then the two
# ladder rows again with the wide tier before it (64 keys, 2 warps, splits toward 264 programs).
# Run from the repository root on the device: bash runs/examples/h200-issue40-s8/call3.sh; results in /tmp/o.
source scripts/device_setup.sh >/dev/null 2>&1; rm -rf runs/2026*; O=/tmp/o; mkdir -p $O; nvidia-smi -L > $O/gpus.txt
L="measure.kernels=true measure.profile_steps=4 measure.trace=false"
timeout 230 python3 -m harness run +experiment=optimize 'run.only=[best-b32-balanced,best-b64-balanced]' $L \
    run.name=ladder > $O/ladder.log 2>&1
timeout 170 python3 -m harness run +experiment=throughput workload.routing=balanced execution.preprocess=device \
    'throughput.tokens={mean: 620, spread: 150, seed: 0}' 'throughput.batches=[128]' throughput.window_s=15 \
    run.name=tp620 > $O/tp620.log 2>&1
A="'+experiment=optimize','run.only=[best-b32-balanced,best-b64-balanced]','measure.kernels=true','measure.profile_steps=4'"
P="import sys,runpy; import harness.kernels.decode_attention_triton as d; d.decode_attention.__defaults__=(None, \
d.DecodeAttentionConfig(wide_block_n=64, wide_warps=2, wide_target_programs=None), None);"
timeout 190 python3 -c "$P sys.argv=['harness','run',$A,'measure.trace=false','run.name=ladder-wide-before']; \
runpy.run_module('harness',run_name='__main__')" > $O/ladder-wide-before.log 2>&1
for n in ladder ladder-wide-before; do
    d=$(ls -d runs/*-$n); python3 runs/examples/h200-b32-align/step_kernels.py $d > $O/kernels_$n.txt 2>&1; rm -f $d/kernels.csv
done
tail -qn1 $O/*.log; grep -h "^| best-b[36]" runs/*-ladder*/report.md | grep "balanced (seed" | cut -c1-40,560-760
grep -h "_split_kernel" $O/kernels_*.txt | grep "us  _split"
cp -r runs/2026* $O/
