#!/usr/bin/env bash
# docs/pipeline.md's example exits 0 on 1-4 ranks ((pp, dp) = (1, 1), (2, 1), (1, 3), (2, 2)):
# the last stage's loss falls over 10 steps.
set -u
binary="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpt.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
for n in 1 2 3 4; do
  if ! timeout 200 mpirun --oversubscribe --bind-to none -np "$n" "$binary"; then
    echo "FAILED on $n ranks"
    exit 1
  fi
  echo "passed on $n ranks"
done
