#!/usr/bin/env bash
# A collective that cannot complete must make the job fail within the collective timeout (2 s here),
# with a message naming the collective, its sequence number, sizes and the API that issued it:
#   collective_timeout_test.sh BINARY [skip|callback|recv|send]   (see collective_timeout_main.cc)
# recv and send: a point-to-point operation whose peer never answers; the report names the peer and
# the tag.
set -u
binary="$1"
mode="${2:-skip}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpt.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
failures=0
sizes="2 3 4"
[ "$mode" = callback ] && sizes="2 3"
{ [ "$mode" = recv ] || [ "$mode" = send ]; } && sizes="2"
for n in $sizes; do
  start=$(date +%s)
  timeout 100 mpirun --oversubscribe --bind-to none -np "$n" \
    "$binary" "$mode" > "$work/out_$n.txt" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  cat "$work/out_$n.txt"
  problem=""
  expect() { grep -qF -- "$1" "$work/out_$n.txt" || problem="${problem:+$problem; }no '$1' in the output"; }
  [ $rc -eq 0 ] && problem="the job exited 0"
  [ $rc -eq 124 ] && problem="the job hung until the test's own 100 s guard"
  [ "$elapsed" -gt 40 ] && problem="${problem:+$problem; }it took ${elapsed} s, expected about the 2 s timeout"
  expect "did not complete within 2000 ms"
  if [ "$mode" = recv ]; then
    expect "recv #1 (16 elements of Float from rank 1, tag 42) on MPI group 'world' (rank 0 of 2)"
    expect "issued by pipeline stage 0 > recv labelled 'activations'"
    expect "no send to this rank with tag 42 arrived from rank 1"
  elif [ "$mode" = send ]; then
    expect "send #1 (16 elements of Float to rank 1, tag 43) on MPI group 'world' (rank 0 of 2)"
    expect "issued by pipeline stage 0 > send labelled 'activations'"
    expect "rank 1 has not received this send: it issued no recv from rank 0 with tag 43"
  elif [ "$mode" = callback ]; then
    expect "allreduce #3 (2 elements of Float, SUM) on MPI group 'world'"
    expect "issued by a callback that blocks"
    expect "has been running the completion callback of allreduce #2"
  else
    expect "all_gather_into_tensor #2 (16 elements of Float per rank) on MPI group 'world'"
    expect "issued by fsdp::dcp::save > collective tagged 'save reports'"
    expect "not every rank of the group issued a collective at this point"
  fi
  if [ -n "$problem" ]; then
    echo "FAILED on $n ranks: $problem"
    failures=$((failures + 1))
  else
    echo "passed on $n ranks: aborted after ${elapsed} s (exit code $rc) with the collective named"
  fi
done
exit $failures
