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
# The flight recorder (docs/flight_recorder.md): each rank that can dumps its last collectives there,
# and tools/flight_recorder.py (beside this script's source) must name the rank at fault.
export FSDP_FLIGHT_RECORDER_DIR="$work/flight_recorder"
tool="$(dirname "$(readlink -f "$0")")/../../tools/flight_recorder.py"
extra=()
if [ "$mode" = throw_caught ]; then
  export FSDP_DEBUG=1
  extra=(-x FSDP_DEBUG)
fi

start=$(date +%s)
timeout -s KILL 60 mpirun --oversubscribe --bind-to none -np 3 -x OMP_NUM_THREADS -x FSDP_COMM_TIMEOUT_S \
  -x FSDP_FLIGHT_RECORDER_DIR "${extra[@]}" "$binary" "$mode" > "$work/out.txt" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/out.txt"
echo "--- exit code $rc after ${elapsed} s"

problems=()
expect() { grep -qF -- "$1" "$work/out.txt" || problems+=("no '$1' in the output"); }
if [ -f "$tool" ]; then
  python3 "$tool" "$FSDP_FLIGHT_RECORDER_DIR" --world-size 3 > "$work/fr.txt" 2>&1
  echo "--- tools/flight_recorder.py (exit code $?):"
  cat "$work/fr.txt"
else
  problems+=("no tools/flight_recorder.py at $tool")
  : > "$work/fr.txt"
fi
expect_fr() { grep -qF -- "$1" "$work/fr.txt" || problems+=("no '$1' in tools/flight_recorder.py's output"); }
dumped() { [ -f "$FSDP_FLIGHT_RECORDER_DIR/flight_recorder.rank$1.json" ]; }
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
    # Ranks 0 and 2 dump on the SIGTERM that ends them; the killed rank cannot.
    expect_fr "no dump from rank 1 (killed, stopped, or ended without dumping)"
    for r in 0 2; do dumped $r || problems+=("no flight recorder dump of rank $r"); expect_fr "rank $r (pid"; done
    expect_fr "(3 ranks, world ranks [0, 1, 2]): ranks 0, 2 issued up to sequence number"
    expect_fr "rank 1 left no dump"
    limit=20
    ;;
  stop)
    # The stopped rank never joins step 2's first all-gather: the others' collective timeout
    # reports it (naming the collective) and aborts the job.
    expect "rank 1: SIGSTOP at step 2"
    expect "did not complete within 3000 ms"
    expect "all_gather_into_tensor"
    # The timeout dumps ranks 0 and 2 at step 2's first all-gather; Open MPI then sends the
    # stopped rank 1 SIGCONT and SIGTERM: it dumps at step 1's last collective, or, when it got to
    # issue step 2's first all-gather in between, arrived there 3 s after the others; or it is
    # killed first.
    for r in 0 2; do dumped $r || problems+=("no flight recorder dump of rank $r"); done
    expect_fr "collective all_gather_into_tensor #"
    if dumped 1; then
      grep -qF "rank 1 never arrived (rank 1 at #" "$work/fr.txt" ||
        expect_fr "but rank 1 arrived last,"
      expect_fr "ranks 0, 2"
    else
      expect_fr "no dump from rank 1"
      expect_fr "ranks 0, 2 issued up to sequence number"
    fi
    limit=30
    ;;
  throw)
    # Rank 1's error is printed and it exits; Open MPI ends the job at once.
    expect "rank 1: error:"
    expect "injected fault: rank 1 threw in the forward of blocks.1"
    # Rank 1 exits without dumping; ranks 0 and 2 dump on the SIGTERM that ends them.
    expect_fr "no dump from rank 1"
    for r in 0 2; do dumped $r || problems+=("no flight recorder dump of rank $r"); done
    expect_fr "rank 1 left no dump"
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
    # Every rank ends by itself with the divergence error: the dumps come from
    # fsdp::comm::flight_recorder::dump() in the divergence check (fsdp/divergence.cc), when it calls
    # it; then every rank's dump names the error.
    if dumped 0 || dumped 1 || dumped 2; then
      for r in 0 1 2; do dumped $r || problems+=("no flight recorder dump of rank $r"); done
      expect_fr "the forward order differs across ranks"
    else
      echo "note: no flight recorder dumps (the divergence check does not call flight_recorder::dump)"
    fi
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
