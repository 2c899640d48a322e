#!/usr/bin/env bash
# Download the pure-Python / manylinux wheels the GPU node lacks (it has torch, pandas, numpy,
# pillow, safetensors, matplotlib) into .whl/ for Python $1 (default 3.12). The node has no
# network: carry .whl with the command and install with scripts/device_setup.sh.
set -euo pipefail
PY=${1:-3.12}
cd "$(dirname "$0")/.."
mkdir -p .whl
pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3   # sdist only: build the wheel here
# the sweep extra (hydra/launcher=gpus, slurm, slurm_local) is pure Python too
for p in hydra-core==1.3.2 omegaconf==2.3.0 nvtx==0.2.17 torchlens==2.36.1 graphviz \
         hydra-joblib-launcher==1.2.0 joblib==1.6.0 hydra-submitit-launcher==1.2.0 submitit==1.5.4 cloudpickle==3.1.3 \
         pypdfium2==5.15.2; do
  pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$p"
done
ls -la .whl
