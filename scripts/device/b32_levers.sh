#!/usr/bin/env bash
# Issue 40, batch 32 at 68% of the datasheet: the two levers prepared without a GPU in the eighth session,
# measured in one call from a fresh copy (not yet run on a GPU):
#  1. the decode attention's splits sharing the filled positions at run time (DecodeAttentionConfig.balanced)
#     against fixed ranges of the buffer: bench attention at batches 32 and 64, positions 300 and 413;
#  2. the blocked MoE kernels' down launch under tiles of its own (TritonMoEConfig.down_*): bench moe
#     sweep=down at 32 tokens, the shared expert folded in, balanced routing;
#  3. best-b32-balanced through the ladder with the default attention tiles and with balanced=True.
# Results under $OUT: *.log, the bench tables (attention*.csv, moe.csv), the two ladder reports, kernels_*.txt.
set -o pipefail
source scripts/device_setup.sh >/dev/null 2>&1
OUT=${OUT:-device-out}; mkdir -p "$OUT"; R=/tmp/b32; rm -rf $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for pos in 300 413; do
    timeout 80 python3 -m harness bench attention 'bench.attention.batch=[32,64]' bench.attention.pos=$pos \
        "bench.attention.configs=['balanced=True']" bench.attention.reps=100 run.root=$R run.name=attn$pos \
        > "$OUT/attn$pos.log" 2>&1
done
timeout 150 python3 -m harness bench moe bench.moe.sweep=down 'bench.moe.tokens=[32]' bench.moe.shared=true \
    bench.moe.routing=balanced run.root=$R run.name=moe-down > "$OUT/moe-down.log" 2>&1
A="'+experiment=optimize','run.only=[best-b32-balanced]','measure.kernels=true','measure.profile_steps=4',\
'measure.trace=false','run.root=$R'"
timeout 160 python3 -m harness run +experiment=optimize 'run.only=[best-b32-balanced]' measure.kernels=true \
    measure.profile_steps=4 measure.trace=false run.root=$R run.name=b32-fixed > "$OUT/b32-fixed.log" 2>&1
timeout 160 python3 -c "import sys,runpy; import harness.kernels.decode_attention_triton as d; \
d.decode_attention.__defaults__=(None, d.DecodeAttentionConfig(balanced=True), None); \
sys.argv=['harness','run',$A,'run.name=b32-balanced-splits']; runpy.run_module('harness',run_name='__main__')" \
    > "$OUT/b32-balanced-splits.log" 2>&1
for d in $R/*-b32-*; do
    python3 runs/examples/h200-b32-align/step_kernels.py "$d" > "$OUT/kernels_$(basename "$d").txt" 2>&1
    rm -f "$d/kernels.csv"
done
grep -h "^| best-b32-balanced | static" $R/*/report.md | cut -d'|' -f2,6-8,16
cp -r $R "$OUT/runs"
ls "$OUT"
