#!/usr/bin/env bash
# Runs tests under the sanitizers (configs in .bazelrc, suppressions in tools/sanitizers/):
#   tools/sanitize.sh            ASan+UBSan on the unit tests, then TSan on the threaded tests
#   tools/sanitize.sh asan       only ASan+UBSan          tools/sanitize.sh tsan   only TSan
#   tools/sanitize.sh asan //tests/comm:mpi_backend_test  (a narrower target set)
# Multi-rank tests run on 1-4 MPI ranks as usual. Each config builds into its own output folder and
# leaves the bazel-* convenience links alone. The last line is
#   "sanitizers: asan+ubsan N passed, M failed; tsan N passed, M failed; R sanitizer reports"
# and the exit status is non-zero when anything failed or any sanitizer report was printed.
set -uo pipefail
cd "$(dirname "$0")/.."

# ASan+UBSan (CI's set, chosen to fit its time budget): the contract, engine-layout and storage unit
# tests, the MPI backend on 1-4 ranks, and the thread backend. `tools/sanitize.sh asan -- //tests/...
# -//tests/python/... -//tests/gpu/...` runs every C++ test (about 45 minutes cold on 2 cores).
ASAN_TARGETS=(
  //tests/contract/...
  //tests/fsdp/...
  //tests/storage/...
  //tests/testing:thread_backend_test
  //tests/comm:mpi_backend_test
  //tests/comm:launch_env_test
)
# TSan: the tests that run our own threads: the MPI progress thread (mpi_backend_test, and every
# multi-rank test through it: fully_shard_training_test), ranks as threads (thread_backend_test), and
# the asynchronous checkpoint writer (distributed_checkpoint_test).
TSAN_TARGETS=(
  //tests/testing:thread_backend_test
  //tests/comm:mpi_backend_test
  //tests/composable:fully_shard_training_test
  //tests/composable:distributed_checkpoint_test
)

which="${1:-all}"
[ $# -gt 0 ] && shift
case "$which" in
  all|asan|tsan) ;;
  *) echo "usage: $0 [all|asan|tsan] [targets...]" >&2; exit 2 ;;
esac
if [ $# -gt 0 ]; then ASAN_TARGETS=("$@"); TSAN_TARGETS=("$@"); fi

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
      -*) expr="$expr - ${p#-}" ;;
      *) expr="${expr:+$expr + }$p" ;;
    esac
  done
  echo "$expr"
}

# run_config CONFIG LABEL TARGETS...: bazel test, then counts the test cases and sanitizer reports
# of exactly those targets' logs.
run_config() {
  local config="$1" label="$2"; shift 2
  local start=$SECONDS
  echo "=== $label: bazel test --config=$config $*"
  bazel test --config="$config" --symlink_prefix=/ --keep_going "$@"
  local rc=$?
  local testlogs
  testlogs="$(bazel info --config="$config" bazel-testlogs 2>/dev/null)"
  local picked
  picked="$(mktemp -d /tmp/sanitize.XXXXXX)"
  local n=0
  while read -r target; do
    local dir="$testlogs/${target#//}"
    dir="${dir/://}"
    if [ -d "$dir" ]; then ln -s "$dir" "$picked/t$n"; n=$((n + 1)); fi
  done < <(bazel query --noshow_progress "tests($(query_of "$@"))" 2>/dev/null)
  local counts
  counts="$(python3 tools/summarize_tests.py "$picked" "$rc" | tail -1)"
  local found
  found="$(cat "$picked"/*/test.log 2>/dev/null |
             grep -cE '^(==[0-9]+==ERROR: (Address|Leak)Sanitizer|WARNING: ThreadSanitizer|SUMMARY: UndefinedBehaviorSanitizer|.*: runtime error: )')"
  rm -rf "$picked"
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
