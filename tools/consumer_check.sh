#!/usr/bin/env bash
# Checks the library from another Bazel workspace, as a monorepo uses it: checks that the README's
# example and BUILD/.bazelrc lines are examples/consumer's files (tools/check_readme_snippets.py), builds
# examples/consumer (which declares this repository with local_repository and calls
# fsdp_dependencies()) in an output base of its own, with that workspace's .bazelrc only (no
# language level, no ~/.bazelrc), then runs the README's example under mpirun on 1 and 2 ranks and
# train_tiny alone and on 1 and 2 ranks; train_tiny checks each step's loss against an unsharded
# reference. Prints the time of each phase
# and ends with "consumer check: passed" (exit 0) or "consumer check: FAILED" (exit 1).
#
#   tools/consumer_check.sh                     # a fresh output base in /tmp, removed at the end
#   FSDP_CONSUMER_OUTPUT_BASE=/path tools/consumer_check.sh    # keep and reuse one
#   FSDP_CONSUMER_DISK_CACHE=/path tools/consumer_check.sh     # the disk cache (empty: none)
#
# The consumer compiles the library's sources again (they are @fsdp_cpp's there, not the main
# workspace's, so the main workspace's outputs cannot be reused). Its actions go to a Bazel disk
# cache, by default ~/.cache/fsdp_cpp/consumer_disk_cache: kept between CI runs, a rerun of an
# unchanged library is a cache hit even from a fresh output base.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
consumer="$root/examples/consumer"

fail() { echo "consumer check: $*" >&2; echo "consumer check: FAILED"; exit 1; }

python3 "$root/tools/check_readme_snippets.py" "$root" ||
  fail "the README's consumer snippets differ from examples/consumer (see above)"
if grep -q -- '-std=' "$consumer/.bazelrc"; then
  fail "examples/consumer/.bazelrc sets a language level; the library's targets must not need one"
fi

output_base="${FSDP_CONSUMER_OUTPUT_BASE:-}"
remove_output_base=0
if [ -z "$output_base" ]; then
  output_base=$(mktemp -d /tmp/fsdp_consumer.XXXXXX)
  remove_output_base=1
fi
work=$(mktemp -d /tmp/fsdpc.XXXXXX)  # short: Open MPI's socket paths live under TMPDIR
bazel_cmd=(bazel --nohome_rc --output_base="$output_base")
cleanup() {
  (cd "$consumer" && "${bazel_cmd[@]}" shutdown >/dev/null 2>&1)
  if [ "$remove_output_base" = 1 ]; then
    chmod -R u+w "$output_base" 2>/dev/null
    rm -rf "$output_base"
  fi
  rm -rf "$work"
}
trap cleanup EXIT

build_flags=(--symlink_prefix=/)  # no bazel-* links inside this repository's tree
disk_cache="${FSDP_CONSUMER_DISK_CACHE-$HOME/.cache/fsdp_cpp/consumer_disk_cache}"
if [ -n "$disk_cache" ]; then
  mkdir -p "$disk_cache"
  build_flags+=(--disk_cache="$disk_cache")
fi

start=$(date +%s)
echo "=== building //:train (the README's example) and //:train_tiny in examples/consumer (output base $output_base)"
(cd "$consumer" && "${bazel_cmd[@]}" build "${build_flags[@]}" //:train //:train_tiny) ||
  fail "the consumer workspace does not build"
built=$(date +%s)
bin_dir=$(cd "$consumer" && "${bazel_cmd[@]}" info "${build_flags[@]}" bazel-bin 2>/dev/null) ||
  fail "bazel info bazel-bin failed"
binary="$bin_dir/train_tiny"
[ -x "$binary" ] || fail "$binary was not built"
[ -x "$bin_dir/train" ] || fail "$bin_dir/train was not built"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export TMPDIR="$work"
for n in 1 2; do
  echo "=== the README's example under mpirun on $n rank(s)"
  mpirun --oversubscribe --bind-to none -np "$n" -x OMP_NUM_THREADS "$bin_dir/train" ||
    fail "the README's example failed on $n rank(s)"
done
echo "=== train_tiny without a launcher"
"$binary" || fail "train_tiny failed without a launcher"
for n in 1 2; do
  echo "=== train_tiny under mpirun on $n rank(s)"
  mpirun --oversubscribe --bind-to none -np "$n" -x OMP_NUM_THREADS "$binary" ||
    fail "train_tiny failed on $n rank(s)"
done
ran=$(date +%s)

echo "consumer check: build $((built - start)) s, runs $((ran - built)) s, total $((ran - start)) s"
echo "consumer check: passed"
