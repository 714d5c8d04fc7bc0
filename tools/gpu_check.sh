#!/usr/bin/env bash
# The GPU checks in one go (on a machine with an NVIDIA GPU): NCCL parity at world size 1 for every
# strategy, mixed precision and CPU offload, with step time and peak CUDA memory. Exits 0 saying so
# where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine: nothing to check (the CUDA code is compiled and linked by tools/test.sh)"
  exit 0
fi
nvidia-smi -L
bazel build -c opt //tests/gpu:gpu_check
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 bazel-bin/tests/gpu/gpu_check
