#!/usr/bin/env bash
# Runs the whole test suite: installs what is missing, checks that every Python import of the tree is
# in tools/requirements.txt (tools/check_requirements.py) and that every cc target includes only
# headers of its direct deps (tools/check_layering.py), then `bazel test //...` (multi-rank tests
# run on 1, 2, 3 and 4 MPI ranks; Python tests run in the environment tools/setup.sh builds from
# exactly that list), then counts test cases over every test's JUnit report and ends with
# "N passed, M failed". Extra arguments go to `bazel test` (e.g. a narrower target pattern).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1
. tools/python_env.sh
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(//...)
# Checks outside Bazel join the count through this file (CI passes its own with earlier checks).
extra="${FSDP_EXTRA_RESULTS:-}"
if [ -z "$extra" ]; then
  extra=$(mktemp /tmp/fsdp_test_extra.XXXXXX)
  trap 'rm -f "$extra"' EXIT
fi
if "$FSDP_PYTHON" tools/check_requirements.py; then
  echo "python_requirements passed" >> "$extra"
else
  echo "python_requirements failed" >> "$extra"
fi
if python3 tools/check_layering.py; then
  echo "layering_check passed" >> "$extra"
else
  echo "layering_check failed" >> "$extra"
fi
# The CMake build's target list (cmake/targets.cmake) must match the BUILD files.
if python3 tools/cmake/gen_cmake_targets.py --check; then
  echo "cmake_targets_check passed" >> "$extra"
else
  echo "cmake_targets_check failed" >> "$extra"
fi
# A disk cache shared by every checkout on this machine (a fresh clone reuses what another built;
# FSDP_DISK_CACHE= turns it off).
cache="${FSDP_DISK_CACHE-$HOME/.cache/fsdp_cpp/disk_cache}"
bazel test --keep_going ${cache:+--disk_cache="$cache"} "${targets[@]}"
rc=$?
FSDP_EXTRA_RESULTS="$extra" python3 tools/summarize_tests.py bazel-testlogs "$rc"
