#!/usr/bin/env bash
# Nsight Systems capture of one stage's NVTX range, then the two stats reports as CSV.
#   scripts/nsys_stage.sh STAGE [harness run overrides...]    e.g. scripts/nsys_stage.sh decode
set -euo pipefail
STAGE=${1:?stage: sam|clip|projector|prefill|decode|request}; shift
nsys profile -t cuda,nvtx --capture-range=nvtx --nvtx-capture="${STAGE}@harness" --capture-range-end=stop \
  -f true -o "nsys-${STAGE}" python -m harness run measure.kernels=false measure.warmup=0 measure.repeats=1 "$@"
nsys stats --report nvtx_gpu_proj_sum,cuda_gpu_kern_sum --format csv --force-export=true \
  --output "nsys-${STAGE}" "nsys-${STAGE}.nsys-rep"
