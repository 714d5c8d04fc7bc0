#!/usr/bin/env bash
# The GPU checks binary (NCCL, CUDA streams, offload) links with no unresolved symbols and runs:
# the checks themselves where a GPU is visible, a clear "not run" line elsewhere.
set -u
binary="$1"
if ldd -r "$binary" 2>&1 | grep -E "undefined symbol|not found"; then
  echo "FAILED: unresolved symbols or libraries in $binary"; exit 1
fi
out=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$binary" 2>&1); rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAILED: exit code $rc"; exit 1; }
echo "$out" | grep -qE "no CUDA device visible|^[0-9]+ passed, 0 failed$" || { echo "FAILED: unexpected output"; exit 1; }
