#!/usr/bin/env bash
# Runs one multi-rank test binary on each requested world size with real processes over MPI:
#   run_mpi_test.sh BINARY WORLD_SIZES [catch2 args...]      e.g. run_mpi_test.sh ./t 1,2,3,4
# One mpirun per world size. Rank 0 writes a JUnit report per launch; the reports are merged into
# Bazel's XML_OUTPUT_FILE (each test case once per world size) so test cases are counted, and a
# launch that died without a report counts as a failed test case.
set -u
binary="$1"; shift
sizes="$1"; shift

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1
# Bazel's TMPDIR is too long for Open MPI's socket paths: use a short folder, removed at exit.
work=$(mktemp -d /tmp/fsdpt.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"

forward=(-x OMP_NUM_THREADS -x FSDP_TEST_JUNIT -x FSDP_TEST_TMPDIR)
# The sanitizer builds' settings (.bazelrc: --config=asan|ubsan|tsan) reach every rank.
for var in FSDP_TEST_TIMEOUT_S FSDP_COMM_TIMEOUT_S ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS; do
  if [ -n "${!var:-}" ]; then forward+=(-x "$var"); fi
done
merge="${TEST_SRCDIR:-/nonexistent}/${TEST_WORKSPACE:-fsdp_cpp}/tests/testing/merge_junit.py"
[ -f "$merge" ] || merge="$(dirname "$(readlink -f "$0")")/merge_junit.py"

status=0
reports=()
IFS=',' read -r -a world_sizes <<< "$sizes"
# FSDP_TEST_MAX_RANKS=N leaves out the launches on more than N ranks, saying so (CI's sanitizer run
# uses 3: its 4-rank launches are the slowest; tools/longer_run.sh runs them all).
max_ranks="${FSDP_TEST_MAX_RANKS:-}"
for n in "${world_sizes[@]}"; do
  if [ -n "$max_ranks" ] && [ "$n" -gt "$max_ranks" ]; then
    echo "=== $(basename "$binary") on $n rank(s): not launched (FSDP_TEST_MAX_RANKS=$max_ranks)"
    continue
  fi
  report="$work/junit_ws${n}.xml"
  shared="$work/shared_ws${n}"
  mkdir -p "$shared"
  echo "=== $(basename "$binary") on $n rank(s)"
  FSDP_TEST_JUNIT="$report" FSDP_TEST_TMPDIR="$shared" \
    mpirun --oversubscribe --bind-to none -np "$n" \
      "${forward[@]}" \
      "$binary" "$@"
  rc=$?
  if [ $rc -ne 0 ]; then status=1; fi
  reports+=("$n:$rc:$report")
done

python3 "$merge" "${XML_OUTPUT_FILE:-$work/merged.xml}" "$(basename "$binary")" "${reports[@]}" || status=1
exit $status
