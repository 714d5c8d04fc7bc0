#!/usr/bin/env bash
# docs/communication.md's point-to-point example exits 0 on 2 and 3 ranks (it checks what it received).
set -u
binary="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpt.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
for n in 2 3; do
  if ! timeout 100 mpirun --oversubscribe --bind-to none -np "$n" "$binary"; then
    echo "FAILED on $n ranks"
    exit 1
  fi
  echo "passed on $n ranks"
done
