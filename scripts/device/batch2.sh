#!/usr/bin/env bash
# GPU batch: ncu probes (metric names, NVTX filter syntax, tensor-counter scale), the default run
# with kernel capture, and the overhead benchmark. Results under $OUT.
source scripts/device_setup.sh
set -x
ncu --version | tail -1
ncu --query-metrics --chip gh100 2>/dev/null | grep -E "sm__ops_path_tensor_src_bf16|sass_thread_inst_executed_op_(f|h)(fma|add|mul)_pred_on|dram__bytes_(read|write)\b|gpu__time_duration" | head -20
M="gpu__time_duration.sum,sm__ops_path_tensor_src_bf16_dst_fp32.sum,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum,dram__bytes_read.sum,dram__bytes_write.sum"
for f in "harness@request/sam/" "harness@sam/" "harness@request/decode/" "harness@*/sam/" "request/sam/"; do
  echo "== filter $f"
  ncu --nvtx --nvtx-include "$f" --clock-control none --metrics $M --csv --page raw --print-units base python scripts/device/ncu_probe.py 2>&1 | grep -v "^==PROF==" | cut -c1-400 | tail -4
done
python -m harness run measure.kernels=true run.root=/tmp/runs 2>&1 | grep -v "^USDT" | tee $OUT/run.log
(cd /tmp/runs && tar czf $OUT/run.tgz .)
python scripts/bench_overhead.py --rounds 6 2>&1 | grep -v "^USDT\|UserWarning\|_warn_once" | tee $OUT/bench.log
