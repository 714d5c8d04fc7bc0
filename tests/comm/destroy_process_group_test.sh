#!/usr/bin/env bash
# destroy_process_group on MPI: on 1-4 ranks the program inits, communicates, destroys, and every
# rank exits 0 cleanly (no MPI error at exit, nothing torn down during static destruction).
#   destroy_process_group_test.sh BINARY
set -u
binary="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpd.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
failures=0
for n in 1 2 3 4; do
  timeout -k 10 120 mpirun --oversubscribe --bind-to none -np "$n" "$binary" > "$work/out_$n.txt" 2>&1
  rc=$?
  ok=$(grep -c "destroy ok" "$work/out_$n.txt")
  problem=""
  [ $rc -eq 124 ] && problem="the job hung until the test's 120 s guard"
  [ $rc -ne 0 ] && [ -z "$problem" ] && problem="mpirun exited $rc"
  [ "$ok" -ne "$n" ] && problem="${problem:+$problem; }$ok of $n ranks finished"
  grep -qiE "MPI_ABORT|mpi_finalize|after MPI_FINALIZE|terminate called|Segmentation" "$work/out_$n.txt" &&
    problem="${problem:+$problem; }MPI or runtime errors in the output"
  if [ -n "$problem" ]; then
    echo "FAILED on $n ranks: $problem; output:"
    cat "$work/out_$n.txt"
    failures=$((failures + 1))
  else
    echo "passed on $n ranks:"
    cat "$work/out_$n.txt"
  fi
done
exit $failures
