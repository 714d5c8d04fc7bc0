#!/usr/bin/env bash
# A checkpoint of pipeline stages (pp = 2, on 2 and 4 ranks) read by Python's
# torch.distributed.checkpoint.load with HuggingFaceStorageReader: every FQN of the whole model
# present once, values bit for bit those this library loads from it (tests/python/dcp_read_checkpoint.py).
#   pipeline_interop_test.sh PIPELINE_INTEROP_MAIN PYTHON DCP_READ_PY
set -u
main="$1"; python="$2"; dcp_read="$3"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdppi.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
for n in 2 4; do
  out="$work/w$n"
  echo "=== save pipeline stages on $n ranks"
  timeout 300 mpirun --oversubscribe --bind-to none -np "$n" -x OMP_NUM_THREADS "$main" "$out" \
    || { echo "FAILED: pipeline_interop_main on $n ranks"; exit 1; }
  echo "=== Python DCP reads the $n-rank pipeline checkpoint"
  "$python" "$dcp_read" "$out/ckpt" "$out/full/model.safetensors" \
    || { echo "FAILED: Python's read of the $n-rank pipeline checkpoint"; exit 1; }
done
echo "PASSED"
