#!/usr/bin/env bash
# GPU batch 3: GPU tests, reference and vendor runs with kernel capture, overhead benchmark,
# ncu tensor-counter scale. Needs carry: .whl .whl-vendor models
source scripts/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .whl-vendor/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -m pytest -q tests/test_measure.py -k gpu 2>&1 | tail -3
python -m harness run measure.kernels=true run.root=/tmp/runs 2>&1 | grep -v "^USDT" | tee $OUT/ref.log
PYTHONPATH=/tmp/vsite:$PYTHONPATH python -m harness run model=vendor measure.kernels=true run.root=/tmp/runs 2>&1 | grep -v "^USDT\|Warning\|warn" | tee $OUT/vendor.log
(cd /tmp/runs && tar czf $OUT/runs.tgz --exclude='*.hydra*' .)
M="gpu__time_duration.sum,sm__ops_path_tensor_src_bf16_dst_fp32.sum,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum,dram__bytes_read.sum,dram__bytes_write.sum"
ncu --nvtx --nvtx-include "harness@request/sam/" --clock-control none --metrics $M --csv --page raw --print-units base python scripts/device/ncu_probe.py > /tmp/probe.csv 2>/dev/null
python - <<'PY'
from harness.external.ncu import parse_raw_csv
df = parse_raw_csv(open("/tmp/probe.csv").read())
print(df[["kernel", "duration_ns", "tensor_ops_bf16", "ffma", "dram_read_bytes", "dram_write_bytes"]].to_string())
if len(df):
    print("FLOPs per tensor-path op:", 2 * 2048 ** 3 / df["tensor_ops_bf16"].sum())
PY
python scripts/bench_overhead.py --rounds 8 2>&1 | grep -v "^USDT\|UserWarning\|_warn_once" | tee $OUT/bench.log
