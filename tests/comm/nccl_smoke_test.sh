#!/usr/bin/env bash
# The NCCL binary links with no unresolved symbols (ldd -r), really loads libtorch_cuda, and runs
# (a one-rank all-gather and reduce-scatter on a GPU machine; "skipped: no CUDA device" elsewhere).
set -u
binary="$1"
ldd_out=$(ldd -r "$binary" 2>&1)
if echo "$ldd_out" | grep -E "undefined symbol|not found"; then
  echo "FAILED: $binary has unresolved symbols or libraries"
  exit 1
fi
for lib in libtorch_cuda.so libc10_cuda.so libnccl; do
  if ! echo "$ldd_out" | grep -q "$lib"; then
    echo "FAILED: $binary does not load $lib"
    exit 1
  fi
done
echo "ldd -r: no unresolved symbols; libtorch_cuda, libc10_cuda and NCCL are loaded"
out=$("$binary" 2>&1)
rc=$?
echo "$out"
if [ $rc -ne 0 ]; then echo "FAILED: exit code $rc"; exit 1; fi
echo "$out" | grep -q "^CUDA hooks registered by libtorch_cuda" || { echo "FAILED: CUDA not registered"; exit 1; }
echo "$out" | grep -qE "^skipped: no CUDA device$|all-gather ok, reduce-scatter ok \(backend nccl\)" || {
  echo "FAILED: unexpected output"; exit 1; }
