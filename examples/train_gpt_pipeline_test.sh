#!/usr/bin/env bash
# The pipeline example (docs/pipeline.md) on 1-4 ranks: every schedule, (pp, dp) and
# (pp, tp) layouts, interleaved stages, activation checkpointing and per-microbatch reduction;
# each run's final loss must match the same training unsharded on one process (train_gpt_pipeline
# checks it itself and exits 1 otherwise). Also: flags it refuses, with their errors.
set -u
train="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpp.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
fail() { echo "FAILED: $*"; exit 1; }
run() {  # run NP ARGS...: the example must exit 0 and report a match
  local np=$1; shift
  echo "== -np $np $*"
  timeout 600 mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS "$train" --steps 8 "$@" \
    > "$work/out.log" 2>&1
  local rc=$?
  cat "$work/out.log"
  [ $rc -eq 0 ] || fail "train_gpt_pipeline -np $np $* exited with $rc"
  grep -q ": match$" "$work/out.log" || fail "no match with the unsharded run for -np $np $*"
}
run 1 --pp 1 --microbatches 2
run 2 --pp 2 --schedule gpipe --microbatches 4
run 2 --pp 2 --stages-per-rank 2 --schedule interleaved_1f1b --microbatches 4
run 3 --pp 3 --layers 6 --schedule 1f1b --microbatches 2
run 4 --pp 2 --microbatches 4 --schedule 1f1b
run 4 --pp 2 --tp 2 --microbatches 4 --schedule 1f1b
run 4 --pp 4 --schedule gpipe --microbatches 8 --checkpoint-activations --reduce-every-microbatch
# Refused before training, with an error naming the problem.
expect_error() {  # expect_error NP PATTERN ARGS...
  local np=$1 pattern=$2; shift 2
  timeout 120 mpirun --oversubscribe --bind-to none -np "$np" "$train" --steps 2 "$@" > "$work/err.log" 2>&1 \
    && fail "train_gpt_pipeline $* should have failed"
  grep -q "$pattern" "$work/err.log" || { cat "$work/err.log"; fail "no '$pattern' for $*"; }
  echo "refused as expected: $*"
}
expect_error 1 "does not divide --batch" --pp 1 --microbatches 3
expect_error 2 "several stages per rank need interleaved_1f1b" --pp 2 --stages-per-rank 2 --schedule 1f1b
expect_error 2 "multiple of the pipeline group's 2 ranks" --pp 2 --stages-per-rank 2 --schedule interleaved_1f1b --microbatches 3 --batch 6
echo "PASSED"
