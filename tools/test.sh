#!/usr/bin/env bash
# Runs the whole test suite: installs what is missing, then `bazel test //...` (multi-rank tests run
# on 1, 2, 3 and 4 MPI ranks), then counts test cases over every test's JUnit report and ends with
# "N passed, M failed". Extra arguments go to `bazel test` (e.g. a narrower target pattern).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(//...)
# A disk cache shared by every checkout on this machine (a fresh clone reuses what another built;
# FSDP_DISK_CACHE= turns it off).
cache="${FSDP_DISK_CACHE-$HOME/.cache/fsdp_cpp/disk_cache}"
bazel test --keep_going ${cache:+--disk_cache="$cache"} "${targets[@]}"
rc=$?
python3 tools/summarize_tests.py bazel-testlogs "$rc"
