#!/bin/bash
# Call 6 of issue 40's ninth session (one H200): the decode attention's wide-tier tiles again, now that the
# splits share the filled positions (each split reads cdiv(filled, splits) blocks, so the best split count and
# tile may have moved): bench attention at batches 32 and 64, positions 300 and 413, the default against
# other split targets, tiles, warps and pipeline stages. A kernel bench only: no ladder runs here.
# Run from the repository root on the device: bash runs/examples/h200-issue40-s9/call6.sh; results in $OUT.
source scripts/device_setup.sh >/dev/null 2>&1; O=${OUT:-/tmp/o}; R=$O/runs; mkdir -p $R; nvidia-smi -L > $O/gpus.txt
C="'wide_target_programs=640','wide_target_programs=2560','wide_target_programs=5120','wide_block_n=16'"
C="$C,'wide_block_n=16;wide_target_programs=2560','wide_warps=2','wide_block_n=64;wide_warps=2'"
C="$C,'wide_block_n=64;wide_warps=2;wide_target_programs=2560','stages=2'"
for pos in 300 413; do
    timeout 110 python3 -m harness bench attention 'bench.attention.batch=[32,64]' bench.attention.pos=$pos \
        "bench.attention.configs=[$C]" bench.attention.reps=100 run.root=$R run.name=wide$pos > $O/wide$pos.log 2>&1
    grep "last-split" $O/wide$pos.log | sed 's/.*per row: //' | cut -c1-150 | sort -t, -k1,1 -k5.11n
done
tail -qn1 $O/*.log
