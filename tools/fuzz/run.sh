#!/usr/bin/env bash
# The benchmark-style campaign of the parser fuzzer (tools/fuzz/README.md): builds
# //tools/fuzz:parser_fuzz, then runs every target for 100000 mutated inputs (seed 1) with the
# checked-in foreign seed files (a torch.save'd .pt, Python-written safetensors), and prints one
# line per target (inputs, accepted, refused, findings, time). Findings go to
# /tmp/fsdp_fuzz_findings (an input and a .txt with its reproducer each; --findings=DIR to move
# them). Extra arguments go to the fuzzer, e.g.
#
#   tools/fuzz/run.sh                                   # all targets, 100000 inputs each
#   tools/fuzz/run.sh --targets=pt,hf_index --inputs=20000 --seed=7
#   tools/fuzz/run.sh --config=asan_ubsan --inputs=5000 # under the sanitizers (a build of its own)
#
# A --config=NAME first argument is passed to bazel build (the fuzzer then runs from that
# configuration's output folder). Exit status: the fuzzer's (0 no finding, 1 findings, 2 error).
set -euo pipefail
cd "$(dirname "$0")/../.."

config=()
if [ $# -gt 0 ] && [[ "$1" == --config=* ]]; then
  # Its own output folder, and the bazel-* convenience links left alone (as tools/sanitize.sh).
  config=("$1" --symlink_prefix=/)
  shift
fi
cache="${FSDP_DISK_CACHE-$HOME/.cache/fsdp_cpp/disk_cache}"
cache_flag=()
[ -n "$cache" ] && cache_flag=(--disk_cache="$cache")

nice -n 10 bazel build "${config[@]}" "${cache_flag[@]}" //tools/fuzz:parser_fuzz
binary="$(bazel info "${config[@]}" bazel-bin 2>/dev/null)/tools/fuzz/parser_fuzz"
# Under the sanitizers: a report ends the worker (a finding, with the report in its .txt); RLIMIT_AS
# is off (ASan reserves terabytes of address space), ASan's own bound on one allocation stands in.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:max_allocation_size_mb=2048:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"

exec "$binary" --inputs=100000 --seed=1 --max_crashes=100000 --findings="${TMPDIR:-/tmp}/fsdp_fuzz_findings" \
  --extra_seed=pt:tests/checkpoint/testdata/python_dict.pt \
  --extra_seed=pt:tests/checkpoint/testdata/python_state_dict.pt \
  --extra_seed=safetensors:tests/storage/testdata/python_safetensors.safetensors \
  --extra_seed=safetensors:tests/storage/testdata/dcp_hf_shard.safetensors \
  --extra_seed=dcp_hf:tests/storage/testdata/dcp_hf_shard.safetensors \
  "$@"
