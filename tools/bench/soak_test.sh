#!/usr/bin/env bash
# A short soak on 2 ranks: the CPU allocator's live bytes after each reported step stay the same
# and the RSS stays within 8 MiB (tools/bench/soak.cc exits 1 otherwise), without and with
# activation checkpointing.
set -u
soak="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdps.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
status=0
for extra in "" "--checkpoint-activations"; do
  echo "=== soak $extra"
  timeout 300 mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS "$soak" \
    --steps 120 --every 20 --layers 2 --d-model 64 --context 32 --batch 8 $extra || status=1
done
exit $status
