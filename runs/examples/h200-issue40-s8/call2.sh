#!/bin/bash
# Call 2 of issue 40's eighth session (one H200): the skinny kernel's tiles at the model's q/k/v and o_proj
# shapes, the fastest of them at 32 rows picked, then best-b32-balanced with cuBLAS against that tile.
# Run from the repository root on the device: bash runs/examples/h200-issue40-s8/call2.sh; results in /tmp/o.
source scripts/device_setup.sh >/dev/null 2>&1; rm -rf runs/2026*; O=/tmp/o; mkdir -p $O; nvidia-smi -L > $O/gpus.txt
S="'block_n=16;num_stages=10','block_n=16;block_k=256;num_stages=5','block_n=32;num_stages=10'"
S="$S,'block_n=16;block_k=64;num_stages=12','block_n=16;unroll=True','block_n=16;unroll=True;num_warps=8'"
S="$S,'block_n=32;unroll=True;num_warps=8','block_n=16;block_k=256;unroll=True;num_warps=8'"
timeout 100 python3 -m harness bench linear 'bench.linear.rows=[8,32,64]' "bench.linear.shapes=['q|k|v|o','qkv (fused)']" \
    "bench.linear.skinny=[$S]" run.name=lin > $O/lin.log 2>&1
python3 - > $O/pick.txt <<'EOF'
import collections, csv, glob, re
rows = list(csv.DictReader(open(glob.glob("runs/*-lin/linear.csv")[0])))
total = collections.defaultdict(float)          # µs per call at 32 rows, q|k|v|o + qkv, per method
for r in rows:
    if r["gemv_rows"] == "32":
        total[r["method"]] += float(r["us_call"])
_, best = min((v, k) for k, v in total.items() if k.startswith("skinny"))
m = re.match(r"skinny (\d+)x(\d+) w(\d+) (unrolled|s(\d+))", best)
print(f"block_n={m[1]};block_k={m[2]};num_warps={m[3]};" + ("unroll=True" if m[4] == "unrolled" else f"num_stages={m[5]}"))
EOF
cat $O/pick.txt
A="'+experiment=optimize','run.only=[best-b32-balanced]','measure.kernels=true','measure.profile_steps=4','measure.trace=false'"
P="import sys,runpy; import harness.variants.fused_linears as f; from harness.bench.config import config_changes as c; \
from harness.kernels.skinny_gemm_triton import SkinnyConfig as K;"
R="runpy.run_module('harness',run_name='__main__')"
timeout 170 python3 -c "$P f.SKINNY_MAX_ROWS=1; sys.argv=['harness','run',$A,'run.name=b32-cublas']; $R" > $O/b32-cublas.log 2>&1
timeout 170 python3 -c "$P f.SKINNY_TILES=c(open('$O/pick.txt').read().strip(), K()); \
sys.argv=['harness','run',$A,'run.name=b32-skinny']; $R" > $O/b32-skinny.log 2>&1
for n in b32-cublas b32-skinny; do
    d=$(ls -d runs/*-$n); python3 runs/examples/h200-b32-align/step_kernels.py $d > $O/kernels_$n.txt 2>&1; rm -f $d/kernels.csv
done
timeout 60 python3 -m pytest -q tests/test_skinny_gemm.py tests/test_decode_attention_triton.py -p no:cacheprovider > $O/t1.log 2>&1
tail -qn1 $O/*.log; grep -h "^| best-b32" runs/*/report.md | head -4; grep "rows 32" $O/lin.log | cut -c80-200
cp -r runs/2026* $O/
