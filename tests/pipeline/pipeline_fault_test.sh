#!/usr/bin/env bash
# A pipeline stage that fails mid-step (tests/pipeline/pipeline_fault_main.cc) on 3 ranks, with a
# short collective timeout (FSDP_COMM_TIMEOUT_S=3): the job must end well within a 60 s guard,
# the failing stage's error naming the stage and microbatch ("throw"), and the ranks waiting for
# its transfers reporting which transfer they waited for.
#   pipeline_fault_test.sh BINARY throw|shape|kill
set -u
binary="$1"
mode="$2"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export FSDP_COMM_TIMEOUT_S=3
work=$(mktemp -d /tmp/fsdppf.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
start=$(date +%s)
timeout -s KILL 60 mpirun --oversubscribe --bind-to none -np 3 -x OMP_NUM_THREADS -x FSDP_COMM_TIMEOUT_S \
  "$binary" "$mode" > "$work/out.txt" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/out.txt"
echo "--- exit code $rc after ${elapsed} s"
problems=()
expect() { grep -qF -- "$1" "$work/out.txt" || problems+=("no '$1' in the output"); }
[ $rc -eq 0 ] && problems+=("the job exited 0")
[ "$elapsed" -ge 59 ] && problems+=("the job hung until the test's 60 s guard")
for r in 0 1 2; do expect "rank $r: step 1 done"; done
case "$mode" in
  throw)
    expect "rank 1: error: fsdp::pipeline::PipelineSchedule: stage 1 of 3 (pipeline rank 1) failed in the forward of microbatch 1: stage 1 failed on purpose"
    # Stage 0 waits for the gradient stage 1 never sends; stage 2 for its transfer with stage 1
    # (its gradient of microbatch 0 not received, or microbatch 1's activation not sent): each
    # reports it at the timeout.
    expect "rank 0: recv"
    expect "labelled 'gradient of microbatch 0 from stage 1 to stage 0' did not complete within 3000 ms"
    grep -Eq "rank 2: (send|recv) .* labelled '[a-z]+ of microbatch [01] from stage (1 to stage 2|2 to stage 1)' did not complete" \
      "$work/out.txt" || problems+=("no timeout report of stage 2's transfer with stage 1")
    ;;
  shape)
    expect "rank 1: error: fsdp::pipeline::PipelineSchedule: stage 1 of 3 (pipeline rank 1) returned an output of shape [2, 2] and dtype Float for microbatch 1, but the shape agreed with stage 2 for this step's input is [2, 4] with dtype Float"
    expect "labelled 'gradient of microbatch 0 from stage 1 to stage 0' did not complete within 3000 ms"
    ;;
  kill)
    expect "rank 1: SIGKILL in step 2"
    ;;
esac
if [ ${#problems[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${problems[@]}"
  exit 1
fi
echo "PASSED"
