#!/usr/bin/env bash
# The composition-root example (tools/example.sh --dp/--tp/--pp) on 1-4 ranks: the layouts of the
# docs/composition.md with dropout 0.1 and clipping on (the defaults); every step's loss
# must match the same training unsharded on one process with the same seeds (train_gpt_parallel
# checks it itself and exits 1 otherwise). Also: layouts it refuses, with their errors.
set -u
train="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpq.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
fail() { echo "FAILED: $*"; exit 1; }
run() {  # run NP ARGS...: the example must exit 0 and report a match
  local np=$1; shift
  echo "== -np $np $*"
  timeout 600 mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS "$train" --steps 6 "$@" \
    > "$work/out.log" 2>&1
  local rc=$?
  cat "$work/out.log"
  [ $rc -eq 0 ] || fail "train_gpt_parallel -np $np $* exited with $rc"
  grep -q ": match$" "$work/out.log" || fail "no match with the unsharded run for -np $np $*"
}
run 1
run 2 --tp 2
run 4 --dp 2 --tp 2 --clip 0.05
grep -q "(clipped)" "$work/out.log" || fail "--clip 0.05 did not clip"
run 4 --pp 2 --dp 2
run 4 --pp 2 --tp 2 --checkpoint-activations
run 4 --dp-replicate 2 --dp 2
# Refused before training on every rank, with an error naming the problem.
expect_error() {  # expect_error NP PATTERN ARGS...
  local np=$1 pattern=$2; shift 2
  timeout 120 mpirun --oversubscribe --bind-to none -np "$np" "$train" --steps 2 "$@" > "$work/err.log" 2>&1 \
    && fail "train_gpt_parallel $* should have failed"
  grep -q "$pattern" "$work/err.log" || { cat "$work/err.log"; fail "no '$pattern' for $*"; }
  echo "refused as expected: $*"
}
expect_error 4 "does not divide the world size 4" --tp 3
expect_error 2 "multiply to 4, expected the world size 2" --dp 2 --tp 2
expect_error 4 "expected at least one block per stage" --pp 4 --layers 2
echo "PASSED"
