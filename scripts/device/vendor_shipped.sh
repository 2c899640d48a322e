#!/usr/bin/env bash
# Issue 36 on a GPU machine: flash-attn built from the carried sdist, its kernels checked against torch
# SDPA, the bf16 parity of the vendor model, and the runs of the vendor's workload as shipped.
# Carry .whl .whl-vendor .flash-attn models .devstamp. Sections: fa check parity crop eager ours ref graph tar
#   bash scripts/device/vendor_shipped.sh fa parity crop eager graph tar; then ... fa ours ref tar
set -u
source scripts/device_setup.sh
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .whl-vendor/*.whl
export PYTHONPATH=/tmp/vsite:$PYTHONPATH HARNESS_VENDOR_DIR=models/deepseek-ocr
quiet() { grep -v "^USDT\|UserWarning\|_warn_once\|==PROF==\|transitioning\|warnings.warn" ; }
V="model=vendor model.path=models/deepseek-ocr model.trust_remote_code=true"
BEST="execution.kv_cache=static execution.moe_impl=grouped execution.cuda_graphs=decode execution.prefill_graphs=true execution.linear_impl=fused execution.decode_attention=triton execution.vision_impl=fused execution.vision_compile=true execution.decode_step=fused execution.pdl=true"
row() {  # row NAME SECONDS OVERRIDES...
  local name=$1 secs=$2; shift 2
  /usr/bin/time -f "$name wall %e s" timeout "$secs" python3 -m harness run +experiment=crop_mode "$@" \
    run.root=/tmp/vs run.name="$name" 2>&1 | quiet | tail -3 | tee -a "$OUT/rows.log"
}
for section in "$@"; do
  s=$SECONDS; echo "== $section"
  case $section in
    fa)     python3 scripts/flash_attn_wheel.py install --target /tmp/fasite 2>&1 | tail -5 | tee "$OUT/fa.log"
            mkdir -p "$OUT/fa" && cp .flash-attn/wheels/*/* "$OUT/fa/" ;;
    check)  PYTHONPATH=/tmp/fasite:$PYTHONPATH python3 scripts/device/fa_check.py 2>&1 | tee -a "$OUT/fa.log" ;;
    parity) PYTHONPATH=/tmp/fasite:$PYTHONPATH timeout 300 python3 -m pytest -q -s -p no:cacheprovider \
              tests/test_vendor_flash.py -m gpu 2>&1 | quiet | tail -12 | tee "$OUT/parity.log" ;;
    crop)   export PYTHONPATH=/tmp/fasite:$PYTHONPATH
            row vendor-infer-fa2 240 $V model.vendor_entry=infer model.attn_implementation=flash_attention_2 ;;
    eager)  row vendor-infer-eager 240 $V model.vendor_entry=infer model.attn_implementation=eager ;;
    ours)   export PYTHONPATH=/tmp/fasite:$PYTHONPATH
            row vendor-ours-fa2 150 $V model.attn_implementation=flash_attention_2 ;;
    ref)    row vendor-style 150
            row best-fused 240 $BEST ;;
    graph)  export PYTHONPATH=/tmp/fasite:$PYTHONPATH
            timeout 150 python3 -m harness graph $V model.vendor_entry=infer model.attn_implementation=flash_attention_2 \
              run.root=/tmp/vs run.name=graph-infer 2>&1 | quiet | grep -v "^\s*$" | tail -8 | tee "$OUT/graph.log" ;;
    tar)    (cd /tmp/vs && tar czf "$OUT/vs.tgz" --exclude=kernels.csv --exclude=traces --exclude=routing_steps.csv .) ;;
  esac
  echo "[$section: $((SECONDS - s)) s]" | tee -a "$OUT/times.txt"
done
