#!/usr/bin/env bash
# Benchmarks replicate (bucketed all-reduce overlapping backward) against fully_shard NO_SHARD on
# the GPT of //examples:gpt_model at world size 2, in one run: prints the median step time of each
# and their ratio (tools/bench/replicate_bench.cc says what is measured).
#
#   tools/replicate_benchmark.sh [replicate_bench flags, e.g. --steps 30 --layers 6]
#
# Builds with -c opt, without Bazel's convenience symlinks; one intra-op thread per rank.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build -c opt --symlink_prefix=/ //tools/bench:replicate_bench >&2
bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/replicate_bench"
work=$(mktemp -d /tmp/repb.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMPDIR="$work" mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS -x MKL_NUM_THREADS \
  "$bin" "$@"
