#!/usr/bin/env bash
# A pipeline stage that fails mid-step (tests/pipeline/pipeline_fault_main.cc) on 3 ranks, with a
# short collective timeout (FSDP_COMM_TIMEOUT_S=3). "throw" and "shape": every rank prints the
# same error naming the failing stage and microbatch, no rank reports a timeout, step 3 runs on
# every rank and the job exits 0. "kill": the job ends well within a 60 s guard (the ranks waiting
# for the dead rank's transfers end with the timeout report).
#   pipeline_fault_test.sh BINARY throw|shape|kill
set -u
binary="$1"
mode="$2"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export FSDP_COMM_TIMEOUT_S=3
work=$(mktemp -d /tmp/fsdppf.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
# The flight recorder (docs/flight_recorder.md): each rank that can dumps its last operations there,
# and tools/flight_recorder.py (beside this script's source) must name the peer that never sent.
export FSDP_FLIGHT_RECORDER_DIR="$work/flight_recorder"
tool="$(dirname "$(readlink -f "$0")")/../../tools/flight_recorder.py"
start=$(date +%s)
timeout -s KILL 60 mpirun --oversubscribe --bind-to none -np 3 -x OMP_NUM_THREADS -x FSDP_COMM_TIMEOUT_S \
  -x FSDP_FLIGHT_RECORDER_DIR "$binary" "$mode" > "$work/out.txt" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/out.txt"
echo "--- exit code $rc after ${elapsed} s"
problems=()
expect() { grep -qF -- "$1" "$work/out.txt" || problems+=("no '$1' in the output"); }
[ "$elapsed" -ge 59 ] && problems+=("the job hung until the test's 60 s guard")
for r in 0 1 2; do expect "rank $r: step 1 done"; done
same_error() {  # every rank printed "$1" as its error, and nobody timed out
  for r in 0 1 2; do expect "rank $r: error: $1"; expect "rank $r: step 3 done"; done
  grep -q "did not complete within" "$work/out.txt" && problems+=("a rank reported a timeout")
  [ $rc -ne 0 ] && problems+=("the job exited $rc")
}
case "$mode" in
  throw)
    same_error "fsdp::pipeline::PipelineSchedule::step: rank 1: stage 1 of 3 (pipeline rank 1) failed in the forward of microbatch 1: stage 1 failed on purpose. Every rank of the pipeline group ends this step with this error"
    ;;
  shape)
    same_error "fsdp::pipeline::PipelineSchedule::step: rank 1: stage 1 of 3 (pipeline rank 1) returned an output of shape [2, 2] and dtype Float for microbatch 1, but the shape agreed with stage 2 for this step's input is [2, 4] with dtype Float"
    ;;
  kill)
    [ $rc -eq 0 ] && problems+=("the job exited 0")
    expect "rank 1: SIGKILL in step 2"
    # Ranks 0 and 2 dump on the SIGTERM that ends them (or on their timeout); the tool names the
    # transfers they wait for and their peer, rank 1, which left no dump.
    if [ -f "$tool" ]; then
      python3 "$tool" "$FSDP_FLIGHT_RECORDER_DIR" --world-size 3 > "$work/fr.txt" 2>&1
      echo "--- tools/flight_recorder.py (exit code $?):"
      cat "$work/fr.txt"
    else
      problems+=("no tools/flight_recorder.py at $tool")
      : > "$work/fr.txt"
    fi
    expect_fr() { grep -qF -- "$1" "$work/fr.txt" || problems+=("no '$1' in tools/flight_recorder.py's output"); }
    for r in 0 2; do
      [ -f "$FSDP_FLIGHT_RECORDER_DIR/flight_recorder.rank$r.json" ] || problems+=("no flight recorder dump of rank $r")
    done
    expect_fr "no dump from rank 1 (killed, stopped, or ended without dumping)"
    expect_fr "rank 2's recv #"
    expect_fr "from group rank 1 (tag"
    expect_fr "its peer, rank 1, left no dump: no matching send is known"
    ;;
esac
if [ ${#problems[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${problems[@]}"
  exit 1
fi
echo "PASSED"
