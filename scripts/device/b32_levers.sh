#!/usr/bin/env bash
# Issue 40, batch 32 at 68% of the datasheet: the three levers prepared without a GPU in the eighth session,
# measured in one call from a fresh copy (not yet run on a GPU):
#  1. the decode attention's splits sharing the filled positions at run time (DecodeAttentionConfig.balanced)
#     against fixed ranges of the buffer: bench attention at batches 32 and 64, positions 300 and 413;
#  2. the blocked MoE kernels' down launch under tiles of its own (TritonMoEConfig.down_*): bench moe
#     sweep=down at 32 tokens, the shared expert folded in, balanced routing; the fastest tile is picked;
#  3. RoPE and the KV write as one launch after the q/k/v linear (fused_linears.ROPE_KV_MAX_ROWS);
# then best-b32-balanced through the ladder as it is, and with all three (the picked down tile on
# decode-size batches), each with its profiled step's kernel table (each lever's kernels apart).
# Results under $OUT: *.log, pick.txt, kernels_*.txt and the runs (bench tables, ladder reports).
set -o pipefail
source scripts/device_setup.sh >/dev/null 2>&1
export OUT=${OUT:-device-out}; mkdir -p "$OUT"; R=/tmp/b32; rm -rf $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# the levers' kernels on the GPU first (they ran in Triton's interpreter only): RoPE + KV write and the
# refactored q/k/v + RoPE GEMV, the balanced splits, the down launch's own tiles
timeout 90 python3 -m pytest -q tests/test_gemv.py tests/test_decode_attention_triton.py tests/test_fast_moe.py \
    -k "rope or balanced or device or down_launch" -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -n1 "$OUT/gpu_tests.log"
for pos in 300 413; do
    timeout 80 python3 -m harness bench attention 'bench.attention.batch=[32,64]' bench.attention.pos=$pos \
        "bench.attention.configs=['balanced=True']" bench.attention.reps=100 run.root=$R run.name=attn$pos \
        > "$OUT/attn$pos.log" 2>&1
done
timeout 150 python3 -m harness bench moe bench.moe.sweep=down 'bench.moe.tokens=[32]' bench.moe.shared=true \
    bench.moe.routing=balanced run.root=$R run.name=moe-down > "$OUT/moe-down.log" 2>&1
python3 - > "$OUT/pick.txt" <<'EOF'
import csv, glob
rows = list(csv.DictReader(open(glob.glob("/tmp/b32/*-moe-down/moe.csv")[0])))
best = min(rows, key=lambda r: float(r["ms_call"]))          # the default row included
print(best["note"] if best["note"].startswith("down=") else "default")
EOF
cat "$OUT/pick.txt"
L="measure.kernels=true measure.profile_steps=4 measure.trace=false run.root=$R"
timeout 160 python3 -m harness run +experiment=optimize 'run.only=[best-b32-balanced]' $L run.name=b32-as-is \
    > "$OUT/b32-as-is.log" 2>&1
timeout 160 python3 - > "$OUT/b32-levers.log" 2>&1 <<'EOF'
import dataclasses, os, runpy, sys
import harness.kernels.decode_attention_triton as d
import harness.kernels.fast_moe_triton as fmt
import harness.variants.fused_linears as fl

d.decode_attention.__defaults__ = (None, d.DecodeAttentionConfig(balanced=True), None)
fl.ROPE_KV_MAX_ROWS = 128
text = open(os.environ.get("OUT", "device-out") + "/pick.txt").read().strip()
if text.startswith("down="):
    n, k, w, st = eval(text[len("down="):])
    plain = fmt.default_triton_config
    fmt.default_triton_config = lambda rows, experts: (
        dataclasses.replace(plain(rows, experts), down_block_n=n, down_block_k=k, down_warps=w, down_stages=st)
        if plain(rows, experts).block_m == 16 else plain(rows, experts))
sys.argv = ["harness", "run", "+experiment=optimize", "run.only=[best-b32-balanced]", "measure.kernels=true",
            "measure.profile_steps=4", "measure.trace=false", "run.root=/tmp/b32", "run.name=b32-levers"]
runpy.run_module("harness", run_name="__main__")
EOF
for d in $R/*-b32-*; do
    python3 runs/examples/h200-b32-align/step_kernels.py "$d" > "$OUT/kernels_$(basename "$d").txt" 2>&1
    rm -f "$d/kernels.csv"
done
grep -h "^| best-b32-balanced | static" $R/*/report.md | cut -d'|' -f2,6-8,16
cp -r $R "$OUT/runs"
ls "$OUT"
