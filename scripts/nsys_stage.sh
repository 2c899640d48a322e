#!/usr/bin/env bash
# Nsight Systems capture of one NVTX range of the first timed request (after one untimed warm-up,
# which emits no ranges), CPU sampling and context-switch trace off, then the two stats reports as CSV.
#   scripts/nsys_stage.sh STAGE [harness run overrides...]    e.g. scripts/nsys_stage.sh request
# Where nsys's importer lacks libdw/libelf: LD_LIBRARY_PATH=.nsysdeps/root/usr/lib/x86_64-linux-gnu (scripts/fetch_nsys_libs.sh).
set -euo pipefail
STAGE=${1:?stage: sam|clip|projector|prefill|decode|request}; shift
nsys profile -t cuda,nvtx --sample=none --cpuctxsw=none --backtrace=none --capture-range=nvtx \
  --nvtx-capture="${STAGE}@harness" --capture-range-end=stop --force-overwrite=true -o "nsys-${STAGE}" \
  python -m harness run measure.kernels=false measure.warmup=1 measure.repeats=1 "$@"
nsys stats --report nvtx_gpu_proj_sum,cuda_gpu_kern_sum --format csv --force-export=true \
  --output "nsys-${STAGE}" "nsys-${STAGE}.nsys-rep"
