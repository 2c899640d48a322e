#!/bin/bash
# Call 3 of issue 40's ninth session (one H200), from the commit that adopted two of the four batch-32
# levers (the decode attention's splits over the filled positions, DecodeAttentionConfig.balanced, now
# the default; RoPE and the KV write as one launch up to fused_linears.ROPE_KV_MAX_ROWS = 128 sequences)
# and deleted the other two: the changed kernels' GPU tests, the attention bench at batches 1-128 (the
# default against the fixed ranges, balanced=False), best-b32-balanced through the ladder, and the
# pipeline at batch 128 and 620 +- 150 tokens.
# Run from the repository root on the device: bash runs/examples/h200-issue40-s9/call3.sh; results in $OUT.
source scripts/device_setup.sh >/dev/null 2>&1; O=${OUT:-/tmp/o}; R=$O/runs; mkdir -p $R; nvidia-smi -L > $O/gpus.txt
timeout 150 python3 -m pytest -q tests/test_gemv.py tests/test_decode_attention_triton.py tests/test_variants.py \
    tests/test_router_triton.py -k "rope or balanced or which_splits or read_on_the_device or gpu_batched or route" \
    -p no:cacheprovider > $O/gpu_tests.log 2>&1
tail -n1 $O/gpu_tests.log
for pos in 300 413; do
    timeout 60 python3 -m harness bench attention 'bench.attention.batch=[1,8,32,64,128]' bench.attention.pos=$pos \
        "bench.attention.configs=['balanced=False']" bench.attention.reps=100 run.root=$R run.name=attn$pos \
        > $O/attn$pos.log 2>&1
    grep "per call" $O/attn$pos.log | grep -v sdpa | cut -c60-175
done
timeout 200 python3 -m harness run +experiment=optimize 'run.only=[best-b32-balanced]' measure.kernels=true \
    measure.profile_steps=4 measure.trace=false run.root=$R run.name=ladder > $O/ladder.log 2>&1
d=$(ls -d $R/*-ladder); python3 runs/examples/h200-b32-align/step_kernels.py $d > $O/kernels_ladder.txt 2>&1
rm -f $d/kernels.csv
grep -h "balanced (seed" $d/report.md | grep -v "| – |" | cut -d'|' -f1-2,6-8,15
timeout 170 python3 -m harness run +experiment=throughput workload.routing=balanced execution.preprocess=device \
    'throughput.tokens={mean: 620, spread: 150, seed: 0}' 'throughput.batches=[128]' throughput.window_s=15 \
    run.root=$R run.name=tp620 > $O/tp620.log 2>&1
tail -qn1 $O/*.log
