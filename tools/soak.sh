#!/usr/bin/env bash
# Soak: trains the example GPT under fully_shard for 1,000 steps on 2 ranks (by default) and prints
# each rank's RSS and the CPU allocator's live bytes every 100 steps, then their growth; exits 1 if
# memory grew (tools/bench/soak.cc says what is measured).
#
#   tools/soak.sh [--np N] [soak flags: --steps 1000 --every 100 --strategy full --checkpoint-activations ...]
set -euo pipefail
cd "$(dirname "$0")/.."
np=2
if [ "${1:-}" = "--np" ]; then np="$2"; shift 2; fi
tools/setup.sh >&2
bazel build -c opt --symlink_prefix=/ //tools/bench:soak >&2
bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/soak"
work=$(mktemp -d /tmp/soak.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMPDIR="$work" mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS "$bin" "$@"
