#!/usr/bin/env bash
# Final GPU checks of this session: the fp32 vendor parity (full size), the bench verb (decode_step,
# attention) and a named execution from the command line. Carry .whl .whl-vendor models .devstamp.
set -u
source scripts/device_setup.sh; export PATH=$PATH:/usr/local/cuda/bin
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .whl-vendor/*.whl 2>/dev/null
export PYTHONPATH=/tmp/vsite:$PYTHONPATH HARNESS_VENDOR_DIR=models/deepseek-ocr; OUT=${OUT:-out}; mkdir -p $OUT
q() { grep -v "^USDT\|UserWarning\|_warn_once\|==PROF==\|warnings.warn\|DeprecationWarning\|jit.script" ; }
s=$SECONDS; timeout 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_vendor_parity.py -m vendor -k full_size 2>&1 | q | tail -30 > $OUT/parity_fp32.log; echo "[parity fp32 $((SECONDS-s)) s]" | tee -a $OUT/parity_fp32.log; tail -4 $OUT/parity_fp32.log
s=$SECONDS; timeout 80 python3 -m harness bench decode_step bench.decode_step.best=false bench.decode_step.rounds=2 bench.decode_step.reps=50 run.root=/tmp/b 2>&1 | q | tail -12 > $OUT/bench.log; echo "[bench decode_step $((SECONDS-s)) s]" >> $OUT/bench.log
s=$SECONDS; timeout 60 python3 -m harness bench attention 'bench.attention.batch=[1,8]' bench.attention.reps=50 run.root=/tmp/b 2>&1 | q | tail -12 >> $OUT/bench.log; echo "[bench attention $((SECONDS-s)) s]" >> $OUT/bench.log; tail -30 $OUT/bench.log
s=$SECONDS; timeout 100 python3 -m harness run execution=best-fused execution.vision_compile=false workload.decode_tokens=64 measure.repeats=3 run.root=/tmp/b run.name=named-best-fused 2>&1 | q | tail -4 > $OUT/named.log; echo "[named $((SECONDS-s)) s]" >> $OUT/named.log; cat $OUT/named.log
(cd /tmp/b && tar czf $OUT/b.tgz --exclude=kernels.csv --exclude=traces .)
