#!/usr/bin/env bash
# Faults in a fully_shard training job on 3 ranks (tests/composable/fault_main.cc): rank 1 fails at
# step 2 while ranks 0 and 2 go on. The job must end, with a clear message, well within a small
# collective timeout (FSDP_COMM_TIMEOUT_S=3), never with MPI_ERR_TRUNCATE; a hard wall-clock guard
# (60 s, SIGKILL) keeps CI from ever hanging.
#   fault_test.sh BINARY kill|stop|throw|throw_caught
set -u
binary="$1"
mode="$2"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export FSDP_COMM_TIMEOUT_S=3
# Bazel's TMPDIR is too long for Open MPI's socket paths: use a short folder, removed at exit.
work=$(mktemp -d /tmp/fsdpf.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
extra=()
if [ "$mode" = throw_caught ]; then
  export FSDP_DEBUG=1
  extra=(-x FSDP_DEBUG)
fi

start=$(date +%s)
timeout -s KILL 60 mpirun --oversubscribe --bind-to none -np 3 -x OMP_NUM_THREADS -x FSDP_COMM_TIMEOUT_S \
  "${extra[@]}" "$binary" "$mode" > "$work/out.txt" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/out.txt"
echo "--- exit code $rc after ${elapsed} s"

problems=()
expect() { grep -qF -- "$1" "$work/out.txt" || problems+=("no '$1' in the output"); }
[ $rc -eq 0 ] && problems+=("the job exited 0")
[ "$elapsed" -ge 59 ] && problems+=("the job hung until the test's 60 s guard")
grep -q "MPI_ERR_TRUNCATE" "$work/out.txt" && problems+=("an MPI_ERR_TRUNCATE error")
# Steps 0 and 1 ran on every rank before the fault.
for r in 0 1 2; do expect "rank $r: step 1 loss"; done
case "$mode" in
  kill)
    # Open MPI notices the dead process at once and ends the job.
    expect "rank 1: SIGKILL at step 2"
    expect "exited on signal 9"
    limit=20
    ;;
  stop)
    # The stopped rank never joins step 2's first all-gather: the others' collective timeout
    # reports it (naming the collective) and aborts the job.
    expect "rank 1: SIGSTOP at step 2"
    expect "did not complete within 3000 ms"
    expect "all_gather_into_tensor"
    limit=30
    ;;
  throw)
    # Rank 1's error is printed and it exits; Open MPI ends the job at once.
    expect "rank 1: error:"
    expect "injected fault: rank 1 threw in the forward of blocks.1"
    limit=20
    ;;
  throw_caught)
    # Rank 1 goes on with step 3 while ranks 0 and 2 are still in step 2: with FSDP_DEBUG=1 the
    # divergence check names it on every rank.
    expect "injected fault: rank 1 threw in the forward of blocks.1"
    expect "rank 1: skipping step 2 and going on"
    for r in 0 1 2; do
      expect "rank $r: error: fully_shard: the forward order differs across ranks in iteration 2: ranks 0,2 have {ran 'blocks.2'"
    done
    expect "rank 1 has {ran '<root>'"
    limit=20
    ;;
  *)
    echo "unknown mode '$mode'"; exit 2 ;;
esac
[ "$elapsed" -gt "$limit" ] && problems+=("it took ${elapsed} s, expected at most ${limit} s")

if [ ${#problems[@]} -gt 0 ]; then
  for p in "${problems[@]}"; do echo "FAILED ($mode): $p"; done
  exit 1
fi
echo "PASSED ($mode): the job ended after ${elapsed} s (exit code $rc) with a clear message"
