#!/usr/bin/env bash
# Benchmarks ring attention (context parallelism, composable/context_parallel.h) at cp = 1 and cp = W
# (default 2) against PyTorch's own ring attention on CPU/Gloo in the same run: one attention layer
# (B=1, H=8, D=64, T=4096, float32, causal, head-tail layout) forward + backward; per side the time
# (median, slowest rank), the counting allocator's peak per rank over forward + backward and the
# bytes held from forward to backward (tools/bench/counting_allocator.h, the same instrument on
# both sides through //tools/bench:libcounting_allocator_capi.so), ratios against cp = 1, and on
# ours the bytes sent against ring_attention_bytes_per_rank. PyTorch's public context_parallel
# does not run on CPU (torch 2.15), so its side runs torch's _templated_ring_attention and its
# backward directly (tools/bench/torch_ring_attention_bench.py).
#
#   tools/ring_attention_benchmark.sh [W=2] [T=4096] [H=8] [D=64] [ITERS=3]
#
# Every process runs one intra-op thread; the C++ program is built with -c opt.
set -euo pipefail
cd "$(dirname "$0")/.."
W="${1:-2}"; T="${2:-4096}"; H="${3:-8}"; D="${4:-64}"; ITERS="${5:-3}"

# shellcheck source=tools/python_env.sh
. tools/python_env.sh
py="$FSDP_PYTHON"
[ -x "$py" ] || { echo "ring_attention_benchmark.sh: $py missing: run tools/setup.sh first" >&2; exit 1; }
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d /tmp/fsdpra.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"

disk_cache=()
[ -d "$HOME/.cache/fsdp_cpp/disk_cache" ] && disk_cache=(--disk_cache="$HOME/.cache/fsdp_cpp/disk_cache")
if ! nice -n 10 bazel build -c opt --symlink_prefix=/ "${disk_cache[@]}" //tools/bench:ring_attention_benchmark \
    //tools/bench:libcounting_allocator_capi.so >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "ring_attention_benchmark.sh: the build failed" >&2
  exit 1
fi
bindir="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench"

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
mpirun --oversubscribe --bind-to none -np "$W" -x OMP_NUM_THREADS "$bindir/ring_attention_benchmark" \
  "$T" "$H" "$H" "$D" "$ITERS"
echo
"$py" tools/bench/torch_ring_attention_bench.py "$W" "$T" "$H" "$D" "$ITERS" "$bindir/libcounting_allocator_capi.so"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
