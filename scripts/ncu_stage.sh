#!/usr/bin/env bash
# Nsight Compute over one stage's NVTX range of a harness request.
#   scripts/ncu_stage.sh STAGE [harness run overrides...]    e.g. scripts/ncu_stage.sh sam workload.mode=base
# Writes ncu-<stage>.ncu-rep. Domain `harness`, push/pop stack request > STAGE (trailing slash).
set -euo pipefail
STAGE=${1:?stage: sam|clip|projector|prefill|decode}; shift
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__ops_path_tensor_src_bf16_dst_fp32.sum,\
smsp__sass_thread_inst_executed_op_ffma_pred_on.sum,smsp__sass_thread_inst_executed_op_fadd_pred_on.sum,\
smsp__sass_thread_inst_executed_op_fmul_pred_on.sum,smsp__sass_thread_inst_executed_op_hfma_pred_on.sum,\
smsp__sass_thread_inst_executed_op_hadd_pred_on.sum,smsp__sass_thread_inst_executed_op_hmul_pred_on.sum
exec ncu --nvtx --nvtx-include "harness@request/${STAGE}/" --clock-control none --metrics "$METRICS" \
  --launch-count "${LAUNCH_COUNT:-4000}" --target-processes all -f -o "ncu-${STAGE}" \
  python -m harness run measure.kernels=false measure.warmup=0 measure.repeats=1 "$@"
