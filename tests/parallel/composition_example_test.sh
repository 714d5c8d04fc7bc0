#!/usr/bin/env bash
# docs/composition.md's composition example exits 0 on 1-4 ranks ((dp_shard, tp) = (1, 1), (1, 2), (3, 1),
# (2, 2)), prints three steps with finite losses and norms, and its layout.
set -u
binary="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpc.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
for n in 1 2 3 4; do
  if ! timeout 200 mpirun --oversubscribe --bind-to none -np "$n" "$binary" > "$work/out.log" 2>&1; then
    cat "$work/out.log"; echo "FAILED on $n ranks"; exit 1
  fi
  cat "$work/out.log"
  grep -Eq "^step 2: loss [0-9]+\.[0-9]+, grad norm [0-9]+\.[0-9]+$" "$work/out.log" || { echo "FAILED: no finite step 2 on $n ranks"; exit 1; }
  grep -q "parallel layout (pp=1, dp_replicate=1, dp_shard=$(( n % 2 == 0 ? n / 2 : n )), tp=$(( n % 2 == 0 ? 2 : 1 )))" "$work/out.log" || { echo "FAILED: layout on $n ranks"; exit 1; }
  echo "passed on $n ranks"
done
