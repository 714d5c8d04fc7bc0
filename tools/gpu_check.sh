#!/usr/bin/env bash
# The GPU checks in one go (on a machine with an NVIDIA GPU):
#   1. tests/gpu/gpu_check: NCCL parity at world size 1 for every strategy, mixed precision and CPU
#      offload, with step time and peak CUDA memory against the unsharded model.
#   2. tests/gpu/overlap_check: the fraction of all-gather time hidden under compute with FSDP2's
#      stream order ([Note: streams] in fsdp/device_streams.h) against the serialized order, and the
#      step time against plain LibTorch, over an emulated link of --world ranks (one GPU cannot run
#      NCCL across ranks); losses must agree across orderings (no stream race).
# Extra arguments go to overlap_check (e.g. --world 8 --link-gbps 50 --d-model 1024 --layers 8
# --seq 512 --batch 8 --steps 8). Exits 0 saying so where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine: nothing to check (the CUDA code is compiled and linked by tools/test.sh)"
  exit 0
fi
nvidia-smi -L
bazel build -c opt //tests/gpu:gpu_check //tests/gpu:overlap_check
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
bazel-bin/tests/gpu/gpu_check || status=1
echo
bazel-bin/tests/gpu/overlap_check "$@" || status=1
exit $status
