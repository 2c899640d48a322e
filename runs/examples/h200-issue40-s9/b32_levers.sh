#!/usr/bin/env bash
# Issue 40, batch 32 at 68% of the datasheet: the four levers prepared without a GPU in the eighth session
# (not yet run on a GPU), in two device calls from a fresh copy (each phase's time limits add up to
# at most 510 s):
#
#   bash scripts/device/b32_levers.sh bench
#       the levers' tests on the GPU (they ran in Triton's interpreter only), then
#       1. the decode attention's splits sharing the filled positions (DecodeAttentionConfig.balanced)
#          against fixed ranges: bench attention at batches 32 and 64, positions 300 and 413;
#       2. the blocked MoE's down launch under tiles of its own (TritonMoEConfig.down_*): bench moe
#          sweep=down at 32 tokens, the shared expert folded in, balanced routing; pick.txt names the
#          fastest tile whose output passed (or "default");
#   bash scripts/device/b32_levers.sh ladder "down=(64, 128, 4, 3)"     # pick.txt of the bench phase
#       best-b32-balanced through the ladder as it is, then with all four levers (3. RoPE and the KV
#       write as one launch after the q/k/v linear, fused_linears.ROPE_KV_MAX_ROWS; 4. the router's top-k
#       in its GEMV's launch, fused_linears.ROUTER_ONE_LAUNCH; the picked down tile on decode-size
#       batches), each with its profiled step's kernel table (each lever's kernels apart).
#
# Every run is written under $OUT/runs as it finishes (a call cut short keeps what it finished).
set -o pipefail
phase=${1:?usage: b32_levers.sh bench | ladder PICK}
source scripts/device_setup.sh >/dev/null 2>&1
export OUT=${OUT:-device-out}; mkdir -p "$OUT/runs"; R="$OUT/runs"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "$phase" = bench ]; then
    timeout 240 python3 -m pytest -q tests/test_gemv.py tests/test_decode_attention_triton.py tests/test_fast_moe.py \
        tests/test_variants.py tests/test_router_triton.py \
        -k "rope or balanced or which_splits or read_on_the_device or down_launch or gpu_batched or route" \
        -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n1 "$OUT/gpu_tests.log"
    for pos in 300 413; do
        timeout 60 python3 -m harness bench attention 'bench.attention.batch=[32,64]' bench.attention.pos=$pos \
            "bench.attention.configs=['balanced=True']" bench.attention.reps=100 run.root="$R" run.name=attn$pos \
            > "$OUT/attn$pos.log" 2>&1
        grep "per call" "$OUT/attn$pos.log" | grep -v sdpa | cut -c60-200
    done
    timeout 150 python3 -m harness bench moe bench.moe.sweep=down 'bench.moe.tokens=[32]' bench.moe.shared=true \
        bench.moe.routing=balanced run.root="$R" run.name=moe-down > "$OUT/moe-down.log" 2>&1
    python3 - > "$OUT/pick.txt" <<'EOF'
import csv, glob, os
rows = [r for r in csv.DictReader(open(glob.glob(os.environ["OUT"] + "/runs/*-moe-down/moe.csv")[0]))
        if r["ok"] == "ok"]                                   # a tile whose output failed is never picked
best = min(rows, key=lambda r: float(r["ms_call"]))          # the default row included
print(best["note"] if best["note"].startswith("down=") else "default")
EOF
    cat "$OUT/pick.txt"
elif [ "$phase" = ladder ]; then
    export PICK=${2:?give the pick of the bench phase: default or down=(n, k, warps, stages)}
    L="measure.kernels=true measure.profile_steps=4 measure.trace=false run.root=$R"
    timeout 200 python3 -m harness run +experiment=optimize 'run.only=[best-b32-balanced]' $L run.name=b32-as-is \
        > "$OUT/b32-as-is.log" 2>&1
    timeout 230 python3 - > "$OUT/b32-levers.log" 2>&1 <<'EOF'
import dataclasses, os, runpy, sys
import harness.kernels.decode_attention_triton as d
import harness.kernels.fast_moe_triton as fmt
import harness.variants.fused_linears as fl

d.DEFAULT_CONFIG = d.DecodeAttentionConfig(balanced=True)                                # in the manifest
fl.ROPE_KV_MAX_ROWS = 128                                                                # in the manifest
fl.ROUTER_ONE_LAUNCH = True                                                              # in the manifest
pick = os.environ["PICK"]
if pick.startswith("down="):                   # not in the manifest: this script and its README name it
    n, k, w, st = (int(v) for v in pick[len("down="):].strip("()").split(","))
    plain = fmt.default_triton_config
    fmt.default_triton_config = lambda rows, experts: (
        dataclasses.replace(plain(rows, experts), down_block_n=n, down_block_k=k, down_warps=w, down_stages=st)
        if plain(rows, experts).block_m == 16 else plain(rows, experts))
sys.argv = ["harness", "run", "+experiment=optimize", "run.only=[best-b32-balanced]", "measure.kernels=true",
            "measure.profile_steps=4", "measure.trace=false", f"run.root={os.environ['OUT']}/runs",
            "run.name=b32-levers"]
runpy.run_module("harness", run_name="__main__")
EOF
    for d in "$R"/*-b32-*; do
        python3 runs/examples/h200-b32-align/step_kernels.py "$d" > "$OUT/kernels_$(basename "$d").txt" 2>&1
        rm -f "$d/kernels.csv"
    done
    grep -H "balanced (seed" "$R"/*-b32-*/report.md | grep -v "| – |" | cut -d'|' -f1-2,6-8,15
else
    echo "usage: b32_levers.sh bench | ladder PICK" >&2; exit 2
fi
ls "$OUT" "$R"
