#!/usr/bin/env bash
# A rank that stays alive but skips a collective must make the job fail within the collective
# timeout (2 s here), with a message naming the collective, its sequence number and sizes.
set -u
binary="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpt.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
failures=0
for n in 2 3 4; do
  start=$(date +%s)
  timeout 100 mpirun --oversubscribe --bind-to none -np "$n" "$binary" > "$work/out_$n.txt" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  cat "$work/out_$n.txt"
  problem=""
  [ $rc -eq 0 ] && problem="the job exited 0"
  [ $rc -eq 124 ] && problem="the job hung until the test's own 100 s guard"
  [ "$elapsed" -gt 40 ] && problem="${problem:+$problem; }it took ${elapsed} s, expected about the 2 s timeout"
  grep -q "all_gather_into_tensor #2 (16 elements of Float per rank) on MPI group 'world'" "$work/out_$n.txt" ||
    problem="${problem:+$problem; }no report naming the collective"
  grep -q "did not complete within 2000 ms" "$work/out_$n.txt" || problem="${problem:+$problem; }no timeout in the report"
  if [ -n "$problem" ]; then
    echo "FAILED on $n ranks: $problem"
    failures=$((failures + 1))
  else
    echo "passed on $n ranks: aborted after ${elapsed} s (exit code $rc) with the collective named"
  fi
done
exit $failures
