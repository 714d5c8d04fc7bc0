#!/usr/bin/env bash
# Host memory and time to build and shard a ~1B-parameter GPT (18 blocks, d_model 2048, vocab
# 32000: 0.97e9 parameters, 3.6 GiB in fp32) with and without meta-device init, on 1, 2 and 4
# ranks (tools/bench/meta_init_bench.cc says what each figure is). Every rank prints one line.
#
#   tools/meta_init_benchmark.sh [--sizes "1 2 4"] [--modes "meta eager"] [bench flags: --layers N ...]
#
# The eager runs hold the whole model on every rank: 4 ranks need about 4 x 4.5 GiB of host memory.
set -euo pipefail
cd "$(dirname "$0")/.."
sizes="1 2 4"
modes="meta eager"
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) sizes="$2"; shift 2 ;;
    --modes) modes="$2"; shift 2 ;;
    *) break ;;
  esac
done
tools/setup.sh >&2
# The default (fastbuild) binary: the time is spent in LibTorch's kernels and the allocator, which
# are optimized either way, and the test suite's build cache is reused.
bazel build //tools/bench:meta_init_bench >&2
bin="$(bazel info bazel-bin 2>/dev/null)/tools/bench/meta_init_bench"
work=$(mktemp -d /tmp/metab.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for mode in $modes; do
  for np in $sizes; do
    TMPDIR="$work" mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS "$bin" --mode "$mode" "$@"
  done
done
