#!/usr/bin/env bash
# GPU acceptance of the execution variants, numbers, nsys and vendor-path issues (one or more
# sections per call; results under $OUT). Carry .whl (+ .whl-vendor and models for `vendor`,
# .nsysdeps for `nsys`).
#   bash scripts/device/wave2.sh tests opt bench
#   bash scripts/device/wave2.sh crop ncu nsys vendor
#   bash scripts/device/wave2.sh sweep quick       # decode MoE tiles; vendor-style / compiled / best only
#   bash scripts/device/wave2.sh gpunew battn ladder rest   # new kernels' GPU tests, attention bench, the ladder
set -u
set -o pipefail
source scripts/device_setup.sh
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-device-out}; mkdir -p "$OUT"
quiet() { grep -v "^USDT\|UserWarning\|_warn_once\|==PROF==\|warnings.warn\|FutureWarning" ; }
pack() { (cd "$1" && tar czf "$OUT/$2.tgz" --exclude=kernels.csv --exclude='traces' --exclude='*.ncu-rep' \
          --exclude='*.nsys-rep' --exclude='*.qdstrm' --exclude='*.sqlite' --exclude='kernels_raw.csv' .) ; }
BEST="kv_cache=static moe_impl=grouped cuda_graphs=decode compile=true prefill_graphs=true vision_impl=fused \
linear_impl=fused vision_compile=true decode_attention=triton"
LADDER="vendor-style,static,static-grouped,graphs,compiled,best,best-b32"
kernels() { for f in "$1"/*/kernels.csv "$1"/kernels.csv; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$2-kernels.csv.gz"; done; true; }
# optimize LABEL CASES SECONDS: the optimize experiment's CASES (comma list) with kernel capture under
# /tmp/LABEL; the log, kernels.csv.gz and the run folder (without large files) go to $OUT
optimize() {
  timeout "$3" python -m harness run +experiment=optimize run.only=["$2"] measure.kernels=true run.root=/tmp/$1 2>&1 \
    | quiet | grep -v "repeat [0-9]*/\|warm-up [0-9]" | tail -16 | tee "$OUT/$1.log"
  kernels /tmp/$1/* "$1"; pack /tmp/$1 "$1"
}
for section in "$@"; do
  echo "== $section $(date +%T)"
  s=$SECONDS
  case $section in
    tests)  HARNESS_NSYS_LIBS=$PWD/.nsysdeps/root timeout ${TESTS_S:-330} python -m pytest -q -m gpu -p no:cacheprovider \
              tests/ 2>&1 | grep -E "passed|failed|^FAILED|^E  " | tail -20 | tee "$OUT/gputests.log" ;;
    opt)    timeout 420 python -m harness run +experiment=optimize measure.kernels=true run.root=/tmp/opt 2>&1 | quiet \
              | grep -v "repeat [0-9]*/\|warm-up [0-9]" | tail -20 | tee "$OUT/opt.log"; pack /tmp/opt opt ;;
    bench)  timeout 200 python scripts/bench_overhead.py --rounds 20 --capture-rounds 0 --alt-rounds 6 \
              --execution $BEST 2>&1 | quiet | tail -12 | tee "$OUT/bench.log" ;;
    sweep)  timeout 150 python scripts/bench_fast_moe.py --rows-sweep --tokens 1 2 --reps 50 2>&1 | quiet \
              | tee "$OUT/sweep.log" ;;
    quick)  optimize quick vendor-style,compiled,best 240 ;;
    gpunew) timeout ${GPUNEW_S:-240} python -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_decode_attention_triton.py \
              tests/test_router_triton.py tests/test_fast_moe.py \
              "tests/test_variants.py::test_gpu_fused_vision_matches_vendor_style_fp32" \
              "tests/test_variants.py::test_gpu_variant_matches_vendor_style" 2>&1 | tail -15 \
              | tee "$OUT/gpunew.log" ;;
    best)   optimize best "${ONLY:-vendor-style,best}" 240 ;;
    battn)  timeout 120 python scripts/bench_decode_attention.py 2>&1 | quiet | tail -40 | tee "$OUT/battn.log" ;;
    ladder) optimize ladder "$LADDER" "${LADDER_S:-420}" ;;
    rest)   optimize rest gundam-vendor-style,gundam-best,best-b8,best-b64 "${REST_S:-300}" ;;
    crop)   timeout 300 python -m harness run +experiment=crop_mode measure.kernels=true run.root=/tmp/crop 2>&1 | quiet \
              | tail -3 | tee "$OUT/crop.log"; pack /tmp/crop crop ;;
    ncu)    for st in sam decode; do
              m=all; [ $st = decode ] && m=memory
              timeout 200 python -m harness profile tool=ncu stage=$st profile.metrics=$m workload.decode_tokens=2 \
                run.root=/tmp/prof 2>&1 | quiet | tail -14 | tee -a "$OUT/ncu.log"
            done; pack /tmp/prof prof ;;
    nsys)   HARNESS_NSYS_LIBS=$PWD/.nsysdeps/root timeout 240 python -m harness profile tool=nsys stage=decode \
              workload.decode_tokens=16 run.root=/tmp/nsys 2>&1 | quiet | tail -20 | tee "$OUT/nsys.log"; pack /tmp/nsys nsys
            HARNESS_NSYS_LIBS=$PWD/.nsysdeps/root timeout 150 python -m pytest -q -x -p no:cacheprovider \
              tests/test_nsys.py -m gpu 2>&1 | tail -40 | tee -a "$OUT/nsys.log" ;;
    vendor) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .whl-vendor/*.whl
            for loop in ours hf_generate; do
              PYTHONPATH=/tmp/vsite:$PYTHONPATH timeout 150 python -m harness run +experiment=vendor_paths model=vendor model.trust_remote_code=true \
                model.path=models/deepseek-ocr model.vendor_loop=$loop measure.warmup=0 measure.repeats=1 \
                run.root=/tmp/vendor run.name=vendor-$loop 2>&1 | quiet | tail -3 | tee -a "$OUT/vendor.log"
            done
            timeout 130 python -m harness run +experiment=vendor_paths $(for kv in $BEST; do echo execution.$kv; done) \
              measure.warmup=1 measure.repeats=3 run.root=/tmp/vendor run.name=best 2>&1 | quiet | tail -3 | tee -a "$OUT/vendor.log"
            python scripts/tpot_table.py /tmp/vendor/* 2>&1 | tail -20 | tee -a "$OUT/vendor.log"; pack /tmp/vendor vendor ;;
  esac
  echo "[$section: $((SECONDS - s)) s]" | tee -a "$OUT/times.txt"
done
