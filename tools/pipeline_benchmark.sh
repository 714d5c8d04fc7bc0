#!/usr/bin/env bash
# Benchmarks pipeline parallelism on the example GPT (untied) on the CPU, and prints in one run:
#  1. the bubble fraction of GPipe, 1F1B and interleaved 1F1B (2 stages per rank) at pp = 2 and 4
#     for m = 1, 2, 4, 8 microbatches, measured from PipelineSchedule::last_step_stats(), next to
#     the closed form and simulate_schedule(backward_cost = 2);
#  2. the activation memory per stage at m = 8 (counting CPU allocator, tools/bench/counting_allocator.h);
#  3. the point-to-point bytes per step per rank against the formula;
#  4. the training step of pp=2 x dp=2 (fully_shard inside the stages) against dp=4 (fully_shard
#     alone) on 4 processes, and against local training of the whole model in one process;
#  5. PyTorch's torch.distributed.pipelining (+ FSDP2 for pp=2 x dp=2) on Gloo beside it.
# with the load average before and after and BUSY marks where other processes used the CPU, and
# writes JSON (tools/bench/README.md, "Pipeline parallelism", says what each figure measures).
#
#   tools/pipeline_benchmark.sh [--out PATH.json] [--quick] [--steps N] [--warmup N] [--size "FLAGS"]
#
#   --out PATH.json   merged results (default tools/bench/out/pipeline.json); the programs' raw JSON
#                     goes next to it (pipeline_pp2.json, pipeline_pp4.json, compare_w4.json,
#                     compare_local.json, torch_pp2.json, torch_pp2dp2.json)
#   --quick           3 measured steps after 1 warm-up (a smoke run)
#   --steps N, --warmup N   measured and warm-up steps per configuration (default 10 and 2)
#   --size "FLAGS"    model flags for both programs (default: --vocab 256 --context 64 --d-model 128
#                     --heads 4 --layers 8 --global-batch 8)
#
# Every process runs one intra-op thread. The C++ program is built with -c opt and without Bazel's
# convenience symlinks (bazel-bin keeps pointing wherever the last ordinary build left it). PyTorch's
# side runs in $FSDP_BENCH_PYTHON (tools/setup.sh --bench), else $FSDP_PYTHON (tools/python_env.sh).
# Not a test: nothing in CI runs it (CI only builds //tools/bench:pipeline_bench).
set -euo pipefail
cd "$(dirname "$0")/.."

out=tools/bench/out/pipeline.json
steps=10
warmup=2
size="--vocab 256 --context 64 --d-model 128 --heads 4 --layers 8 --global-batch 8"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --quick) steps=3; warmup=1; shift ;;
    --steps) steps="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "pipeline_benchmark.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
outdir=$(dirname "$out")
mkdir -p "$outdir"
log() { echo "[pipeline_benchmark] $*" >&2; }
load1() { cut -d' ' -f1 /proc/loadavg; }

# shellcheck source=tools/python_env.sh
. tools/python_env.sh
py="$FSDP_BENCH_PYTHON"
[ -x "$py" ] || py="$FSDP_PYTHON"
[ -x "$py" ] || { echo "pipeline_benchmark.sh: no Python environment: run tools/setup.sh first" >&2; exit 1; }

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A short TMPDIR: Open MPI's session directory holds Unix sockets, whose paths are limited.
work=$(mktemp -d /tmp/fsdppp.XXXXXX)
trap 'rm -rf "$work"' EXIT

log "building //tools/bench:pipeline_bench (-c opt)"
disk_cache=()
[ -d "$HOME/.cache/fsdp_cpp/disk_cache" ] && disk_cache=(--disk_cache="$HOME/.cache/fsdp_cpp/disk_cache")
if ! nice -n 10 bazel build -c opt --symlink_prefix=/ "${disk_cache[@]}" //tools/bench:pipeline_bench \
    >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "pipeline_benchmark.sh: the build failed" >&2
  exit 1
fi
bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/pipeline_bench"
[ -x "$bin" ] || { echo "pipeline_benchmark.sh: $bin was not built" >&2; exit 1; }

rm -f "$outdir"/pipeline_pp2.json "$outdir"/pipeline_pp4.json "$outdir"/compare_w4.json \
  "$outdir"/compare_local.json "$outdir"/torch_pp2.json "$outdir"/torch_pp2dp2.json
mpi() {
  local np="$1"; shift
  TMPDIR="$work" mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS -x MKL_NUM_THREADS "$bin" "$@"
}
common=(--warmup "$warmup" --steps "$steps")

start=$SECONDS
load_before=$(load1)
log "load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg) ($(getconf _NPROCESSORS_ONLN) cores)"

# shellcheck disable=SC2086  # $size is a list of flags
{
  log "C++ pp=2 (2 processes): every schedule, m = 1, 2, 4, 8; memory at m = 8"
  mpi 2 --mode pipeline --out "$outdir/pipeline_pp2.json" "${common[@]}" $size
  log "C++ pp=4 (4 processes on $(getconf _NPROCESSORS_ONLN) cores: time-shared)"
  mpi 4 --mode pipeline --out "$outdir/pipeline_pp4.json" "${common[@]}" $size
  log "C++ pp=2 x dp=2 against dp=4 (4 processes)"
  mpi 4 --mode compare --layouts pp2xdp2:1f1b:4,pp2xdp2:gpipe:4,dp4 --out "$outdir/compare_w4.json" "${common[@]}" $size
  log "C++ local training of the whole model (1 process)"
  mpi 1 --mode compare --layouts local --out "$outdir/compare_local.json" "${common[@]}" $size
  log "load average between the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
  log "PyTorch pipelining pp=2 (2 processes, Gloo)"
  timeout 900 "$py" tools/bench/pipeline_bench_torch.py run --world 2 --pp 2 --dp 1 --configs gpipe:4,1f1b:4,gpipe:8,1f1b:8 \
    --out "$outdir/torch_pp2.json" "${common[@]}" $size || log "PyTorch pp=2 failed"
  log "PyTorch pipelining + FSDP2 pp=2 x dp=2 (4 processes, Gloo)"
  timeout 900 "$py" tools/bench/pipeline_bench_torch.py run --world 4 --pp 2 --dp 2 --configs 1f1b:4,gpipe:4 --optimizer \
    --out "$outdir/torch_pp2dp2.json" "${common[@]}" $size || log "PyTorch pp=2 x dp=2 failed"
}

load_after=$(load1)
log "runs took $((SECONDS - start)) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$py" tools/bench/pipeline_bench_torch.py report --dir "$outdir" --out "$out" \
  --load-before "$load_before" --load-after "$load_after"
