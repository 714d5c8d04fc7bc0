#!/usr/bin/env bash
# Benchmarks tensor parallelism x fully_shard on the example GPT at 4 ranks against PyTorch's FSDP2 +
# DTensor tensor parallel (CPU, Gloo) in the same run: (dp, tp) = (4, 1), (2, 2) and (1, 4), the
# last two also with sequence parallel + loss parallel; the same global batch per step in every
# layout. Prints one table (step time C++ / PyTorch, allocator peak per rank and its ratio to
# (4, 1), bytes per collective kind per step on the tp and dp groups against their closed forms),
# the load average before and after, and writes JSON (tools/bench/README.md says what each figure
# measures).
#
#   tools/tp_benchmark.sh [--out PATH.json] [--quick] [--layouts L] [--steps N] [--warmup N]
#
#   --out PATH.json   merged results (default tools/bench/out/tp_results.json); the programs' raw
#                     JSON goes next to it (tp_cpp.json, tp_torch.json)
#   --quick           3 measured steps after 1 warm-up (a smoke run)
#   --layouts L       default 4x1,2x2,2x2+sp,1x4,1x4+sp ("+sp": sequence parallel + loss parallel)
#   --steps N, --warmup N   measured and warm-up steps per layout (default 12 and 3)
#   --size "FLAGS"    model and batch flags for tp_bench --write-init (default: --vocab 512
#                     --context 64 --d-model 256 --heads 8 --layers 4 --global-batch 8)
#
# Every process runs one intra-op thread. The C++ program is built with -c opt and without Bazel's
# convenience symlinks (so bazel-bin keeps pointing wherever the last ordinary build left it). Uses
# the project's Python environment ($FSDP_PYTHON, tools/python_env.sh; torch only).
set -euo pipefail
cd "$(dirname "$0")/.."

out=tools/bench/out/tp_results.json
layouts=4x1,2x2,2x2+sp,1x4,1x4+sp
steps=12
warmup=3
size="--vocab 512 --context 64 --d-model 256 --heads 8 --layers 4 --global-batch 8"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --quick) steps=3; warmup=1; shift ;;
    --layouts) layouts="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "tp_benchmark.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
outdir=$(dirname "$out")
mkdir -p "$outdir"
log() { echo "[tp_benchmark] $*" >&2; }
load1() { cut -d' ' -f1 /proc/loadavg; }

# shellcheck source=tools/python_env.sh
. tools/python_env.sh
py="$FSDP_PYTHON"
[ -x "$py" ] || { echo "tp_benchmark.sh: $py missing: run tools/setup.sh first" >&2; exit 1; }

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A short TMPDIR: Open MPI's session directory holds Unix sockets, whose paths are limited.
work=$(mktemp -d /tmp/fsdptp.XXXXXX)
trap 'rm -rf "$work"' EXIT

log "building //tools/bench:tp_bench (-c opt)"
disk_cache=()
[ -d "$HOME/.cache/fsdp_cpp/disk_cache" ] && disk_cache=(--disk_cache="$HOME/.cache/fsdp_cpp/disk_cache")
if ! nice -n 10 bazel build -c opt --symlink_prefix=/ "${disk_cache[@]}" //tools/bench:tp_bench \
    >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "tp_benchmark.sh: the build failed" >&2
  exit 1
fi
bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/tp_bench"
[ -x "$bin" ] || { echo "tp_benchmark.sh: $bin was not built" >&2; exit 1; }

init="$work/tp_init.pt"
# shellcheck disable=SC2086  # $size is a list of flags
"$bin" --write-init "$init" $size >&2
rm -f "$outdir/tp_cpp.json" "$outdir/tp_torch.json"

start=$SECONDS
load_before=$(load1)
log "load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores; the runs themselves keep 4 ranks busy)"

log "this project: mpirun -np 4 tp_bench ($layouts)"
TMPDIR="$work" mpirun --oversubscribe --bind-to none -np 4 -x OMP_NUM_THREADS -x MKL_NUM_THREADS \
  "$bin" --init "$init" --out "$outdir/tp_cpp.json" --layouts "$layouts" --warmup "$warmup" --steps "$steps" \
  | tee "$work/cpp.txt" >&2
log "load average between the runs: $(cut -d' ' -f1-3 /proc/loadavg)"

log "PyTorch FSDP2 + DTensor TP, 4 processes over Gloo ($layouts)"
"$py" tools/bench/torch_tp_bench.py run --init "$init" --out "$outdir/tp_torch.json" --world 4 \
  --layouts "$layouts" --warmup "$warmup" --steps "$steps" \
  || log "the PyTorch side failed; the table shows the C++ side only"

load_after=$(load1)
log "runs took $((SECONDS - start)) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$py" tools/bench/torch_tp_bench.py report --cpp "$outdir/tp_cpp.json" --py "$outdir/tp_torch.json" \
  --out "$out" --load-before "$load_before" --load-after "$load_after"
