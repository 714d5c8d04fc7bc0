#!/usr/bin/env bash
# Checks the CMake build (CMakeLists.txt, docs/building.md) end to end, as a user of an installed
# fsdp-cpp sees it:
#   1. cmake/targets.cmake is up to date with the BUILD.bazel files (gen_cmake_targets.py --check),
#      and docs/building.md's find_package example is examples/consumer_cmake/CMakeLists.txt;
#   2. configures the library (Ninja when installed), builds every library target (-j2, nice) and
#      installs it into a temporary prefix;
#   3. builds examples/consumer_cmake (find_package(fsdp_cpp), fsdp_cpp::fully_shard; the sources
#      are examples/consumer's) against that prefix alone;
#   4. runs it as tools/consumer_check.sh runs the Bazel consumer: the README's example under mpirun
#      on 1 and 2 ranks (rank 0 prints "step 0..2: loss"), train_tiny without a launcher and under
#      mpirun on 1 and 2 ranks (exit status 0 and "losses match the unsharded reference": each
#      step's loss equals the unsharded run's);
#   5. configures a project that uses the source tree through add_subdirectory (same target names)
#      and checks train_tiny's link line; FSDP_CMAKE_CHECK_SUBDIR_BUILD=1 also builds it there and
#      runs it on 2 ranks (the library compiled a second time).
# Prints the time of each phase and ends with "cmake check: passed" (exit 0) or
# "cmake check: FAILED" (exit 1).
#
#   tools/cmake/check.sh                                   # cold: a temporary build folder
#   FSDP_CMAKE_BUILD_DIR=~/.cache/fsdp_cpp/cmake_build tools/cmake/check.sh   # keep and reuse one
#   FSDP_CMAKE_JOBS=2 (default), FSDP_CMAKE_GENERATOR="Unix Makefiles" (default: Ninja if found)
#   FSDP_CMAKE_CXX=clang++  the library's compiler (default: CMake's choice, the system's c++);
#   the consumer is always built with CMake's default compiler. CI builds the library with Clang
#   (a cold build of every library target is 3-4 times faster: Clang instantiates LibTorch's
#   templates once in the precompiled header, GCC in every file) and the consumer with GCC.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

fail() { echo "cmake check: $*" >&2; echo "cmake check: FAILED"; exit 1; }
phase_start=$(date +%s)
check_start=$phase_start
timings=()
phase_done() {  # phase_done NAME: prints and records the time since the previous phase ended
  local now; now=$(date +%s)
  timings+=("$1 $((now - phase_start)) s")
  echo "--- $1 took $((now - phase_start)) s"
  phase_start=$now
}

jobs="${FSDP_CMAKE_JOBS:-2}"
generator="${FSDP_CMAKE_GENERATOR:-}"
if [ -z "$generator" ]; then
  if command -v ninja >/dev/null; then generator=Ninja; else generator="Unix Makefiles"; fi
fi
command -v cmake >/dev/null || fail "cmake is not installed (tools/setup.sh installs it)"

work=$(mktemp -d /tmp/fsdpcm.XXXXXX)  # short: Open MPI's socket paths live under TMPDIR
build="${FSDP_CMAKE_BUILD_DIR:-}"
remove_build=0
if [ -z "$build" ]; then
  build="$work/build"
  remove_build=1
fi
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

echo "=== cmake/targets.cmake against the BUILD files"
python3 tools/cmake/gen_cmake_targets.py --check || fail "cmake/targets.cmake is out of date (see above)"
# docs/building.md's find_package example (its first cmake block) is the consumer's CMakeLists.txt.
awk '/^```cmake$/ { inside = 1; next } inside && /^```$/ { exit } inside' docs/building.md |
  diff - examples/consumer_cmake/CMakeLists.txt ||
  fail "docs/building.md's first cmake block differs from examples/consumer_cmake/CMakeLists.txt"
phase_done "targets check"

echo "=== configuring the library ($generator, build folder $build)"
# A kept build folder of another checkout (CMakeCache.txt names its source folder) is started over.
if [ -f "$build/CMakeCache.txt" ] &&
   ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$build/CMakeCache.txt"; then
  echo "$build was configured for another source folder; starting it over"
  rm -rf "$build"
fi
compiler=()
[ -n "${FSDP_CMAKE_CXX:-}" ] && compiler=(-DCMAKE_CXX_COMPILER="$FSDP_CMAKE_CXX")
nice -n 19 cmake -S "$root" -B "$build" -G "$generator" -DCMAKE_INSTALL_PREFIX="$prefix" "${compiler[@]}" \
  > "$work/configure.log" 2>&1 || { tail -n 40 "$work/configure.log"; fail "configuring the library failed"; }
grep "^-- fsdp_cpp:" "$work/configure.log"
phase_done "configure"

echo "=== building every library target (-j$jobs, nice)"
nice -n 19 cmake --build "$build" -j "$jobs" --target fsdp_cpp_libraries ||
  fail "the library does not build"
phase_done "build"

echo "=== installing into $prefix"
cmake --install "$build" > "$work/install.log" 2>&1 || { tail -n 20 "$work/install.log"; fail "install failed"; }
[ -f "$prefix/lib/cmake/fsdp_cpp/fsdp_cppConfig.cmake" ] || fail "no fsdp_cppConfig.cmake installed"
[ -f "$prefix/include/fsdp_cpp/composable/fully_shard.h" ] || fail "headers not installed under include/fsdp_cpp/"
echo "$(find "$prefix/lib" -name '*.a' | wc -l) archives, $(find "$prefix/include" -name '*.h' | wc -l) headers"
phase_done "install"

echo "=== building examples/consumer_cmake against the installed prefix"
consumer_build="$work/consumer"
nice -n 19 cmake -S "$root/examples/consumer_cmake" -B "$consumer_build" -G "$generator" \
  -DCMAKE_PREFIX_PATH="$prefix" > "$work/consumer_configure.log" 2>&1 ||
  { tail -n 40 "$work/consumer_configure.log"; fail "the consumer does not configure against $prefix"; }
nice -n 19 cmake --build "$consumer_build" -j "$jobs" || fail "the consumer does not build"
for b in train train_tiny; do
  [ -x "$consumer_build/$b" ] || fail "$consumer_build/$b was not built"
done
phase_done "consumer build"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export TMPDIR="$work"
mpi=(mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS)
for n in 1 2; do
  echo "=== the README's example under mpirun on $n rank(s)"
  "${mpi[@]}" -np "$n" "$consumer_build/train" > "$work/train_$n.log" 2>&1
  rc=$?
  cat "$work/train_$n.log"
  [ $rc -eq 0 ] || fail "the README's example failed on $n rank(s)"
  [ "$(grep -c '^step [0-2]: loss ' "$work/train_$n.log")" -eq 3 ] ||
    fail "the README's example on $n rank(s) did not print 3 steps"
done
echo "=== train_tiny without a launcher"
"$consumer_build/train_tiny" > "$work/tiny_0.log" 2>&1
rc=$?
cat "$work/tiny_0.log"
[ $rc -eq 0 ] && grep -q "on 1 rank(s): losses match the unsharded reference" "$work/tiny_0.log" ||
  fail "train_tiny failed without a launcher"
for n in 1 2; do
  echo "=== train_tiny under mpirun on $n rank(s)"
  "${mpi[@]}" -np "$n" "$consumer_build/train_tiny" > "$work/tiny_$n.log" 2>&1
  rc=$?
  cat "$work/tiny_$n.log"
  [ $rc -eq 0 ] && grep -q "on $n rank(s): losses match the unsharded reference" "$work/tiny_$n.log" ||
    fail "train_tiny failed on $n rank(s)"
done
phase_done "runs"

echo "=== a project using the source tree through add_subdirectory (configure and generate)"
sub="$work/subdir_project"
mkdir -p "$sub"
cat > "$sub/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.25)
project(fsdp_subdir_consumer LANGUAGES CXX)
add_subdirectory("$root" fsdp_cpp)
add_executable(train_tiny "$root/examples/consumer/train_tiny.cc")
target_link_libraries(train_tiny PRIVATE fsdp_cpp::fully_shard)
CMAKE
nice -n 19 cmake -S "$sub" -B "$sub/build" -G "$generator" > "$work/subdir.log" 2>&1 ||
  { tail -n 40 "$work/subdir.log"; fail "add_subdirectory of the source tree does not configure"; }
if [ "${FSDP_CMAKE_CHECK_SUBDIR_BUILD:-0}" = 1 ]; then
  # Opt-in: compiles the library again (the closure of fully_shard, ~60 files) inside that project.
  nice -n 19 cmake --build "$sub/build" -j "$jobs" --target train_tiny ||
    fail "add_subdirectory: train_tiny does not build"
  "${mpi[@]}" -np 2 "$sub/build/train_tiny" > "$work/sub_tiny.log" 2>&1
  rc=$?
  cat "$work/sub_tiny.log"
  [ $rc -eq 0 ] && grep -q "on 2 rank(s): losses match the unsharded reference" "$work/sub_tiny.log" ||
    fail "add_subdirectory: train_tiny failed on 2 ranks"
elif [ "$generator" = Ninja ]; then
  # The link line of train_tiny: the project's archives and LibTorch, without building them.
  (cd "$sub/build" && ninja -t commands train_tiny | tail -n 1 | grep -q "libfsdp_cpp_composable_fully_shard.a") ||
    fail "add_subdirectory: train_tiny does not link fsdp_cpp::fully_shard's archive"
fi
phase_done "add_subdirectory"

[ "$remove_build" = 1 ] && rm -rf "$build"
echo "cmake check: ${timings[*]/%/,} total $(( $(date +%s) - check_start )) s"
echo "cmake check: passed"
