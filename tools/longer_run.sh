#!/usr/bin/env bash
# The longer run: what CI (.ci/run) leaves out for time, in one go (nightly, or before a release).
# Each part is one result; the last line is "N passed, M failed" over the parts, and each part's
# time is printed. Logs go to a folder of their own (printed first).
#
#   0. build_all   bazel build //... (the programs no test runs: benchmarks and demos; CI builds
#                  test targets and their dependencies only)
#   1. asan_all    tools/sanitize.sh asan on every C++ test on 1-4 ranks (CI runs a chosen set on
#                  1-3 ranks)
#   2. tsan        tools/sanitize.sh tsan (the threaded tests)
#   3. ctest       the CMake build with -DFSDP_CPP_BUILD_TESTS=ON and ctest (every registered test,
#                  multi-rank ones on 1-4 ranks through tests/testing/run_mpi_test.sh)
#   4. cmake_subdir tools/cmake/check.sh with FSDP_CMAKE_CHECK_SUBDIR_BUILD=1 (the add_subdirectory
#                  project built and run too)
#   5. benchmark   tools/benchmark.sh --quick (builds -c opt and runs; fails only when a program does)
#   6. soak        tools/soak.sh (1,000 steps on 2 ranks; fails when memory grows)
#   7. gpu         tools/gpu_check.sh (says so and passes where there is no GPU)
#
#   tools/longer_run.sh                 every part
#   tools/longer_run.sh ctest tsan      only the named parts
# Environment: FSDP_LONGER_RUN_CMAKE_DIR (default ~/.cache/fsdp_cpp/cmake_tests: the ctest build
# folder, kept between runs so that a second run is incremental).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(build_all asan_all tsan ctest cmake_subdir benchmark soak gpu)
logs=$(mktemp -d /tmp/fsdp_longer_run.XXXXXX)
echo "logs: $logs"
cmake_dir="${FSDP_LONGER_RUN_CMAKE_DIR:-$HOME/.cache/fsdp_cpp/cmake_tests}"

ctest_part() {
  cmake -S . -B "$cmake_dir" -G Ninja -DFSDP_CPP_BUILD_TESTS=ON &&
    nice -n 19 cmake --build "$cmake_dir" -j 2 &&
    (cd "$cmake_dir" && ctest --output-on-failure)
}

passed=0
failed=0
for part in "${parts[@]}"; do
  start=$SECONDS
  log="$logs/$part.log"
  case "$part" in
    build_all) cmd=(bazel build --keep_going //...) ;;
    asan_all) cmd=(tools/sanitize.sh asan -- //tests/... -//tests/python/... -//tests/gpu/...) ;;
    tsan) cmd=(tools/sanitize.sh tsan) ;;
    ctest) cmd=(ctest_part) ;;
    cmake_subdir) cmd=(env FSDP_CMAKE_CHECK_SUBDIR_BUILD=1 tools/cmake/check.sh) ;;
    benchmark) cmd=(tools/benchmark.sh --quick --out "$logs/benchmark/results.json") ;;
    soak) cmd=(tools/soak.sh) ;;
    gpu) cmd=(tools/gpu_check.sh) ;;
    *) echo "longer_run: unknown part '$part' (build_all asan_all tsan ctest cmake_subdir benchmark soak gpu)" >&2; exit 2 ;;
  esac
  echo "=== $part: ${cmd[*]}"
  if "${cmd[@]}" > "$log" 2>&1; then
    result=passed; passed=$((passed + 1))
  else
    result=failed; failed=$((failed + 1))
    tail -n 30 "$log"
  fi
  echo "=== $part $result in $((SECONDS - start)) s (log: $log)"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
