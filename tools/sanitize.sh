#!/usr/bin/env bash
# Runs tests under the sanitizers (configs in .bazelrc, suppressions in tools/sanitizers/):
#   tools/sanitize.sh            ASan+UBSan on the unit tests, then TSan on the threaded tests
#   tools/sanitize.sh asan       only ASan+UBSan          tools/sanitize.sh tsan   only TSan
#   tools/sanitize.sh asan //tests/comm:mpi_backend_test  (a narrower target set)
# Environment: FSDP_SANITIZE_RESULTS FILE  one line per test target appended ("<label> <target> passed|failed");
#              FSDP_SANITIZE_FAILURES FILE for each failed target, its failed assertions, hangs and
#              sanitizer reports and the end of its log (CI prints it);
#              FSDP_BAZEL_STARTUP  Bazel startup options, e.g. "--output_base=$HOME/.cache/bazel_san"
#              (a server of its own, so a long sanitizer build never blocks the usual one);
#              FSDP_SANITIZE_FLAGS extra `bazel test` options (e.g. "--jobs=1");
#              FSDP_SANITIZE_MAX_RANKS N  multi-rank tests on at most N ranks (CI: 3);
#              FSDP_DISK_CACHE     the disk cache (default ~/.cache/fsdp_cpp/disk_cache, as
#              tools/test.sh; empty turns it off).
# Multi-rank tests run on 1-4 MPI ranks as usual. Each config builds into its own output folder and
# leaves the bazel-* convenience links alone. The last line is
#   "sanitizers: asan+ubsan N passed, M failed; tsan N passed, M failed; R sanitizer reports"
# and the exit status is non-zero when anything failed or any sanitizer report was printed.
set -uo pipefail
cd "$(dirname "$0")/.."

# ASan+UBSan (CI's set, chosen for coverage per minute of a cold CI run): the contract,
# engine-layout and storage unit tests, the MPI backend on 1-4 ranks (its progress thread, size
# check and early starts), the thread backend, training parity (the whole engine), activation
# checkpointing (recompute frees and refills what it saved) and point-to-point send/recv.
# Measured in a cold CI run on 4 Dec with GCC (busy 2-core machine): 1073 s, of which the build
# ~610 s and the tests 462 s (with Clang, the whole phase: 719 s in a cold CI of 697db3d, multi-rank
# tests on 1-3 ranks, the CMake check beside it); per target (all launches): tensor_parallel_test 75 s, activation_checkpoint_test
# 59 s, pipeline_schedule_test 58 s, fully_shard_training_test 49 s, mpi_backend_test 43 s,
# point_to_point_test 35 s, each unit test about 5 s. Left to the longer run for time (clean when
# last run): //tests/composable:tensor_parallel_test and //tests/pipeline:pipeline_schedule_test
# (they also build tensor parallel's and the pipeline's libraries under ASan),
# //tests/composable:fully_shard_test, :replicate_test, //tests/checkpoint/... (1-3 minutes each).
# `tools/sanitize.sh asan -- //tests/... -//tests/python/... -//tests/gpu/...` runs every C++ test.
ASAN_TARGETS=(
  //tests/contract/...
  //tests/fsdp/...
  //tests/storage/...
  //tests/testing:thread_backend_test
  //tests/comm:mpi_backend_test
  //tests/comm:launch_env_test
  //tests/composable:fully_shard_training_test
  //tests/composable:activation_checkpoint_test
  //tests/comm:point_to_point_test
)

# TSan: the tests that run our own threads: the MPI progress thread (mpi_backend_test, and every
# multi-rank test through it: the training, prefetch (several collectives in flight) and replicate
# (buckets issued from autograd hooks) tests), ranks as threads (thread_backend_test), and the
# asynchronous checkpoint writer (distributed_checkpoint_test). About 25 minutes cold on 2 busy
# cores, 4 minutes with the build done.
TSAN_TARGETS=(
  //tests/testing:thread_backend_test
  //tests/comm:mpi_backend_test
  //tests/composable:fully_shard_test
  //tests/composable:fully_shard_training_test
  //tests/composable:fully_shard_prefetch_test
  //tests/composable:replicate_test
  //tests/checkpoint:distributed_checkpoint_test
)

which="${1:-all}"
[ $# -gt 0 ] && shift
case "$which" in
  all|asan|tsan) ;;
  *) echo "usage: $0 [all|asan|tsan] [targets...]" >&2; exit 2 ;;
esac
if [ $# -gt 0 ]; then ASAN_TARGETS=("$@"); TSAN_TARGETS=("$@"); fi

startup=(${FSDP_BAZEL_STARTUP:-})
flags=(${FSDP_SANITIZE_FLAGS:-})
cache="${FSDP_DISK_CACHE-$HOME/.cache/fsdp_cpp/disk_cache}"
[ -n "$cache" ] && flags+=(--disk_cache="$cache")
if [ -n "${FSDP_SANITIZE_MAX_RANKS:-}" ]; then
  # Multi-rank tests launched on at most that many ranks (tests/testing/run_mpi_test.sh says which
  # launches it left out).
  flags+=(--test_env=FSDP_TEST_MAX_RANKS="$FSDP_SANITIZE_MAX_RANKS")
  echo "sanitize.sh: multi-rank tests on at most $FSDP_SANITIZE_MAX_RANKS ranks (FSDP_SANITIZE_MAX_RANKS)"
fi

summary=()
status=0
reports=0

# query_of PATTERNS...: the `bazel query` expression of `bazel test` target patterns
# ("-- //a/... -//a/b/..." -> "//a/... - //a/b/...").
query_of() {
  local expr=""
  for p in "$@"; do
    case "$p" in
      --) ;;
      --*) ;;
      -*) expr="$expr - ${p#-}" ;;
      *) expr="${expr:+$expr + }$p" ;;
    esac
  done
  echo "$expr"
}

# The lines of a test log that start a sanitizer report.
report_pattern='^(==[0-9]+==ERROR: (Address|Leak)Sanitizer|WARNING: ThreadSanitizer|SUMMARY: UndefinedBehaviorSanitizer|.*: runtime error: )'

# run_config CONFIG LABEL TARGETS...: bazel test, then counts the test cases and sanitizer reports
# of exactly those targets' logs. With FSDP_SANITIZE_RESULTS=FILE, appends one line per test target
# to FILE, "<label> <target> passed" or "... failed" (the format of tools/summarize_tests.py's
# FSDP_EXTRA_RESULTS): failed when Bazel did not report it PASSED (build failure, test failure,
# timeout) or its log holds a sanitizer report.
run_config() {
  local config="$1" label="$2"; shift 2
  local start=$SECONDS
  local out
  out="$(mktemp /tmp/sanitize_out.XXXXXX)"
  echo "=== $label: bazel test --config=$config $*"
  bazel "${startup[@]}" test --config="$config" --symlink_prefix=/ --keep_going --test_summary=short \
    "${flags[@]}" "$@" 2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  local testlogs
  testlogs="$(bazel "${startup[@]}" info --config="$config" bazel-testlogs 2>/dev/null)"
  local picked
  picked="$(mktemp -d /tmp/sanitize.XXXXXX)"
  local n=0 found=0
  while read -r target; do
    local dir="$testlogs/${target#//}"
    dir="${dir/://}"
    local result=failed
    if grep -qE "^${target}[[:space:]]+(\(cached\) )?PASSED" "$out"; then result=passed; fi
    if [ -d "$dir" ]; then
      ln -s "$dir" "$picked/t$n"; n=$((n + 1))
      local in_log
      in_log="$(grep -cE "$report_pattern" "$dir/test.log" 2>/dev/null)"
      if [ "${in_log:-0}" -ne 0 ]; then
        result=failed
        found=$((found + in_log))
        echo "=== $label: $target: $in_log sanitizer report(s) in $dir/test.log"
      fi
    fi
    [ -n "${FSDP_SANITIZE_RESULTS:-}" ] && echo "$label $target $result" >> "$FSDP_SANITIZE_RESULTS"
    if [ "$result" = failed ] && [ -n "${FSDP_SANITIZE_FAILURES:-}" ]; then
      # What a reader of CI's output needs to see why: the failed assertions, hangs and sanitizer
      # reports of every rank, then the log's end.
      {
        echo "--- $label $target failed; its log: $dir/test.log"
        if [ -f "$dir/test.log" ]; then
          grep -E "$report_pattern|FAILED in|HUNG|did not complete|TIMEOUT|Segmentation|Aborted|terminate called" \
            "$dir/test.log" | head -n 40
          echo "--- the last 30 lines:"
          tail -n 30 "$dir/test.log"
        else
          echo "(no test log: the build of the target failed)"
        fi
      } >> "$FSDP_SANITIZE_FAILURES"
    fi
  done < <(bazel "${startup[@]}" query --noshow_progress "tests($(query_of "$@"))" 2>/dev/null)
  local counts
  counts="$(python3 tools/summarize_tests.py "$picked" "$rc" | tail -1)"
  rm -rf "$picked" "$out"
  [ "$rc" -ne 0 ] && status=1
  [ "$found" -ne 0 ] && status=1
  reports=$((reports + found))
  echo "=== $label: $counts, $found sanitizer reports, $((SECONDS - start)) s"
  summary+=("$label $counts")
}

[ "$which" != tsan ] && run_config asan_ubsan asan+ubsan "${ASAN_TARGETS[@]}"
[ "$which" != asan ] && run_config tsan tsan "${TSAN_TARGETS[@]}"

line="sanitizers:"
for s in "${summary[@]}"; do line="$line $s;"; done
echo "$line $reports sanitizer reports"
exit $status
