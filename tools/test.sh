#!/usr/bin/env bash
# Runs the whole test suite: installs what is missing, then `bazel test //...` (multi-rank tests run
# on 1, 2, 3 and 4 MPI ranks), then counts test cases over every test's JUnit report and ends with
# "N passed, M failed". Extra arguments go to `bazel test` (e.g. a narrower target pattern).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(//...)
bazel test --keep_going "${targets[@]}"
rc=$?
python3 tools/summarize_tests.py bazel-testlogs "$rc"
