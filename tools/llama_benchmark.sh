#!/usr/bin/env bash
# Benchmarks the Llama training step through the composition root (parallelize(llama_model_spec(...)),
# tools/bench/llama_bench.cc) against PyTorch on the same config, weights and data in the same run:
# transformers' LlamaForCausalLM with FSDP2 fully_shard, DTensor tensor parallel (torchtitan's Llama
# plan) and torch.distributed.pipelining (PipelineStage + Schedule1F1B), composed as torchtitan
# composes them, on the CPU over Gloo (tools/bench/torch_llama_bench.py). Layouts: dp=2 (2 ranks),
# (dp, tp) = (2, 2) and (pp, dp) = (2, 2) (4 ranks). Prints one table (step time and tokens/s per
# rank of both sides and their ratio, the allocator peak per rank of both sides, the C++ job's bytes
# per collective kind and group against the closed forms, the loss of both sides at the first and
# last measured step), the load average before and after with BUSY marks, and writes JSON
# (tools/bench/README.md, "Llama training step", says what each figure measures).
#
#   tools/llama_benchmark.sh [--out PATH.json] [--quick] [--steps N] [--warmup N] [--microbatches M]
#                            [--size "FLAGS"]
#
#   --out PATH.json   merged results (default tools/bench/out/llama.json); the programs' raw JSON goes
#                     next to it (llama_cpp_dp2.json, llama_cpp_w4.json, llama_torch_dp2.json,
#                     llama_torch_w4.json)
#   --quick           3 measured steps after 1 warm-up (a smoke run)
#   --steps N, --warmup N   measured and warm-up steps per layout (default 12 and 3)
#   --microbatches M  microbatches of the pipeline layout (default 4: one sequence each)
#   --size "FLAGS"    model and data flags for `torch_llama_bench.py init` (default: --vocab 512
#                     --hidden 256 --layers 4 --heads 8 --kv-heads 4 --intermediate 688 --seq 64
#                     --global-batch 8)
#
# Both sides load the same Hugging Face folder (written once by transformers' save_pretrained) and
# token file, train float32 with AdamW (lr 1e-3, weight decay 0.1), one intra-op thread per process,
# the same global batch per step in every layout. The C++ programs are built with -c opt and without
# Bazel's convenience symlinks (bazel-bin keeps pointing wherever the last ordinary build left it).
# PyTorch's side runs in $FSDP_BENCH_PYTHON (tools/setup.sh --bench), else $FSDP_PYTHON
# (tools/python_env.sh): torch and transformers only. A benchmark, not a test: nothing in CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

out=tools/bench/out/llama.json
steps=12
warmup=3
microbatches=4
size="--vocab 512 --hidden 256 --layers 4 --heads 8 --kv-heads 4 --intermediate 688 --seq 64 --global-batch 8"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --quick) steps=3; warmup=1; shift ;;
    --steps) steps="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --microbatches) microbatches="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "llama_benchmark.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
outdir=$(dirname "$out")
mkdir -p "$outdir"
log() { echo "[llama_benchmark] $*" >&2; }
load1() { cut -d' ' -f1 /proc/loadavg; }

# shellcheck source=tools/python_env.sh
. tools/python_env.sh
py="$FSDP_BENCH_PYTHON"
[ -x "$py" ] || py="$FSDP_PYTHON"
[ -x "$py" ] || { echo "llama_benchmark.sh: no Python environment: run tools/setup.sh first" >&2; exit 1; }

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TORCH_CPP_LOG_LEVEL=ERROR
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A short TMPDIR: Open MPI's session directory holds Unix sockets, whose paths are limited.
work=$(mktemp -d /tmp/fsdpll.XXXXXX)
trap 'rm -rf "$work"' EXIT

log "building //tools/bench:llama_bench and //tools/bench:libcounting_allocator_capi.so (-c opt)"
disk_cache=()
[ -d "$HOME/.cache/fsdp_cpp/disk_cache" ] && disk_cache=(--disk_cache="$HOME/.cache/fsdp_cpp/disk_cache")
if ! nice -n 10 bazel build -c opt --symlink_prefix=/ "${disk_cache[@]}" //tools/bench:llama_bench \
    //tools/bench:libcounting_allocator_capi.so >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "llama_benchmark.sh: the build failed" >&2
  exit 1
fi
bindir="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench"
bin="$bindir/llama_bench"
alloc_lib="$bindir/libcounting_allocator_capi.so"
if [ ! -x "$bin" ] || [ ! -f "$alloc_lib" ]; then
  echo "llama_benchmark.sh: $bin or $alloc_lib was not built" >&2
  exit 1
fi

init="$work/init"
# shellcheck disable=SC2086  # $size is a list of flags
"$py" tools/bench/torch_llama_bench.py init --dir "$init" --batches $((warmup + steps)) $size
rm -f "$outdir"/llama_cpp_dp2.json "$outdir"/llama_cpp_w4.json "$outdir"/llama_torch_dp2.json \
  "$outdir"/llama_torch_w4.json

common=(--warmup "$warmup" --steps "$steps" --microbatches "$microbatches")
cpp() {
  local np="$1"; shift
  # A rank that fails ends the job instead of waiting in MPI_Finalize for the others.
  TMPDIR="$work" timeout 900 mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS -x MKL_NUM_THREADS \
    "$bin" --init "$init" "${common[@]}" "$@"
}
torch_side() {
  timeout 900 "$py" tools/bench/torch_llama_bench.py run --init "$init" --allocator-lib "$alloc_lib" "${common[@]}" "$@"
}

start=$SECONDS
load_before=$(load1)
log "load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg) ($(getconf _NPROCESSORS_ONLN) cores; the 4-rank runs keep 4 processes busy)"
# Each C++ run is followed by PyTorch's of the same layouts, so that the two sides of a ratio are
# minutes apart at most.
log "C++ dp2 (mpirun -np 2)"
cpp 2 --layouts dp2 --out "$outdir/llama_cpp_dp2.json" || log "the C++ dp2 run failed"
log "PyTorch dp2 (2 processes, Gloo)"
torch_side --world 2 --layouts dp2 --out "$outdir/llama_torch_dp2.json" || log "the PyTorch dp2 run failed"
log "load average between the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
log "C++ dp2xtp2, pp2xdp2 (mpirun -np 4)"
cpp 4 --layouts dp2xtp2,pp2xdp2 --out "$outdir/llama_cpp_w4.json" || log "the C++ 4-rank run failed"
log "PyTorch dp2xtp2, pp2xdp2 (4 processes, Gloo)"
torch_side --world 4 --layouts dp2xtp2,pp2xdp2 --out "$outdir/llama_torch_w4.json" || log "the PyTorch 4-rank run failed"

load_after=$(load1)
log "runs took $((SECONDS - start)) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$py" tools/bench/torch_llama_bench.py report --dir "$outdir" --out "$out" \
  --load-before "$load_before" --load-after "$load_after"
