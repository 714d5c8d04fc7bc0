#!/usr/bin/env bash
# An MPI application that finalises MPI itself (tests/comm/own_mpi_finalize_main.cc) on 2 ranks:
# with the library's communicators (process group, hybrid mesh, fully_shard's derived groups in
# their process-wide cache) destroyed after the program's MPI_Finalize, every rank exits 0 and
# nothing in the output says an MPI call was made after MPI_FINALIZE.
#   own_mpi_finalize_test.sh BINARY
set -u
binary="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpf.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
timeout -k 10 120 mpirun --oversubscribe --bind-to none -np 2 "$binary" > "$work/out.txt" 2>&1
rc=$?
cat "$work/out.txt"
problems=()
[ $rc -eq 124 ] && problems+=("the job hung until the test's 120 s guard")
[ $rc -ne 0 ] && problems+=("mpirun exited $rc")
[ "$(grep -c "own finalize ok" "$work/out.txt")" -eq 2 ] || problems+=("not every rank reached its end")
grep -qiE "after MPI_FINALIZE|MPI_Comm_free|MPI_ABORT|terminate called|Segmentation" "$work/out.txt" &&
  problems+=("MPI or runtime errors in the output")
if [ ${#problems[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${problems[@]}"
  exit 1
fi
echo "PASSED"
