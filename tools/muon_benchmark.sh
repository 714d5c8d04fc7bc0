#!/usr/bin/env bash
# Benchmarks fsdp::optim::Muon's step on a fully_shard model at 2 ranks against (a) every rank
# assembling and orthogonalizing every matrix (MuonDistribution::kEveryRank) and (b)
# torch.optim.Muon on the unsharded matrices (tools/bench/muon_bench_torch.py, one process), all
# in one run, one intra-op thread per process. Prints the three step times and the two ratios
# (owners / every rank, owners / torch) and writes JSON.
#
#   tools/muon_benchmark.sh [--out PATH.json] [--d-model N] [--layers N] [--steps N] [--warmup N]
#
#   --out PATH.json   the merged results (default tools/bench/out/muon_results.json)
#   --d-model N, --layers N   the shapes (default 512 and 2: 12 matrices, per layer q/k/v/o [d, d],
#                     up [4d, d], down [d, 4d])
#   --steps N, --warmup N     measured and warm-up steps (default 10 and 2)
#
# The C++ program is built with -c opt and without Bazel's convenience symlinks. Uses the project's
# Python environment ($FSDP_PYTHON, tools/python_env.sh; torch only).
set -euo pipefail
cd "$(dirname "$0")/.."

out=tools/bench/out/muon_results.json
d=512
layers=2
steps=10
warmup=2
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --d-model) d="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "muon_benchmark.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$(dirname "$out")"
log() { echo "[muon_benchmark] $*" >&2; }

# shellcheck source=tools/python_env.sh
. tools/python_env.sh
py="$FSDP_PYTHON"
[ -x "$py" ] || { echo "muon_benchmark.sh: $py missing: run tools/setup.sh first" >&2; exit 1; }

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A short TMPDIR: Open MPI's session directory holds Unix sockets, whose paths are limited.
work=$(mktemp -d /tmp/fsdpmuon.XXXXXX)
trap 'rm -rf "$work"' EXIT

log "building //tools/bench:muon_bench (-c opt)"
disk_cache=()
[ -d "$HOME/.cache/fsdp_cpp/disk_cache" ] && disk_cache=(--disk_cache="$HOME/.cache/fsdp_cpp/disk_cache")
if ! nice -n 10 bazel build -c opt --symlink_prefix=/ "${disk_cache[@]}" //tools/bench:muon_bench \
    >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "muon_benchmark.sh: the build failed" >&2
  exit 1
fi
bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/muon_bench"
[ -x "$bin" ] || { echo "muon_benchmark.sh: $bin was not built" >&2; exit 1; }

log "load average before: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
TMPDIR="$work" mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS -x MKL_NUM_THREADS \
  "$bin" --d-model "$d" --layers "$layers" --steps "$steps" --warmup "$warmup" --out "$work/cpp.json" \
  --ways owners,every_rank >&2
# The unsharded C++ step in a process of its own (no peer polling in a barrier beside it).
TMPDIR="$work" "$bin" --d-model "$d" --layers "$layers" --steps "$steps" --warmup "$warmup" --out "$work/local.json" \
  --ways local >&2
"$py" tools/bench/muon_bench_torch.py --d-model "$d" --layers "$layers" --steps "$steps" --warmup "$warmup" \
  --out "$work/torch.json" >&2
log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

"$py" - "$work/cpp.json" "$work/torch.json" "$out" "$work/local.json" <<'PY'
import json, sys
cpp = json.load(open(sys.argv[1]))
torch_side = json.load(open(sys.argv[2]))
cpp["ways"].update(json.load(open(sys.argv[4]))["ways"])
ways = cpp["ways"]
owners, every, local = ways["owners"]["step_ms"], ways["every_rank"]["step_ms"], ways["local"]["step_ms"]
result = {
    "world": cpp["world"], "d_model": cpp["d_model"], "layers": cpp["layers"], "steps": cpp["steps"],
    "owners_ms": owners, "every_rank_ms": every, "cpp_unsharded_ms": local, "torch_unsharded_ms": torch_side["step_ms"],
    "owners_over_every_rank": owners / every, "owners_over_torch": owners / torch_side["step_ms"],
    "cpp": cpp,
}
json.dump(result, open(sys.argv[3], "w"), indent=2)
print(f"Muon step at W={cpp['world']} ({6 * cpp['layers']} matrices, d_model {cpp['d_model']}):")
print(f"  fsdp::optim::Muon, owners         {owners:9.2f} ms")
print(f"  every rank orthogonalizes all     {every:9.2f} ms   owners / every rank = {owners / every:.2f}x")
print(f"  torch.optim.Muon unsharded        {torch_side['step_ms']:9.2f} ms   owners / torch      = {owners / torch_side['step_ms']:.2f}x")
print(f"  fsdp::optim::Muon unsharded (C++) {local:9.2f} ms")
PY
