#!/usr/bin/env bash
# Where the GPT step at world size 2 spends the CPU that local training does not: fsdp_bench's GPT
# (the benchmark's model, -c opt) at W=2 under `perf record` (cpu-clock samples, each rank its own
# file, only the measured steps: fsdp_bench switches perf on and off through a control fifo), twice:
#   fsdp   fully_shard alone in both processes (--local 0)
#   local  local training in both processes at once, no communication (--fsdp 0: the concurrent-local
#          reference of tools/benchmark.sh)
# then prints each run's CPU per rank per step by category (LibTorch's compute, copies and fills,
# allocation, Open MPI, the kernel, this library, ...) and by thread (the training thread, the MPI
# backend's progress thread), and the difference: the W=2 row of the targets table, split by cause.
#
#   tools/profile_w2.sh [--steps N] [--repeat R] [--out DIR]
#
#   --steps N    measured GPT steps per run (default 30; 3 warm-up steps are not sampled)
#   --repeat R   runs of each variant, alternated (default 2); the report takes each category's median
#   --out DIR    where perf.data files, fsdp_bench's JSON and the report go (default tools/bench/out/profile_w2)
#
# Needs `perf` (Debian's linux-perf: installed here when missing and this user is root) and
# perf_event_paranoid <= 1 or root.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=30
repeat=2
out=tools/bench/out/profile_w2
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "profile_w2.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
log() { echo "[profile_w2] $*" >&2; }

tools/setup.sh >&2
if ! command -v perf > /dev/null; then
  if [ "$(id -u)" = 0 ]; then
    log "installing linux-perf (Debian)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q linux-perf >&2
  else
    echo "profile_w2.sh: perf is not installed (sudo apt-get install linux-perf)" >&2
    exit 1
  fi
fi
. tools/python_env.sh

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d /tmp/fsdpp.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
rm -f "$out"/*.perf.data "$out"/*.json "$out"/report.txt

log "building //tools/bench:fsdp_bench (-c opt)"
if ! bazel build -c opt --symlink_prefix=/ //tools/bench:fsdp_bench > "$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "profile_w2.sh: the build failed" >&2
  exit 1
fi
bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/fsdp_bench"
init="$work/init.pt"
"$bin" --write-init "$init" > /dev/null

# One rank: perf record with its events off until fsdp_bench's first measured step (-D -1 and the
# fifo pair named by FSDP_BENCH_PERF_CTL / FSDP_BENCH_PERF_ACK).
cat > "$work/rank.sh" <<'RANK'
#!/usr/bin/env bash
set -eu
r=${OMPI_COMM_WORLD_RANK:?}
ctl="$WORK/ctl.$TAG.$r" ack="$WORK/ack.$TAG.$r"
mkfifo "$ctl" "$ack"
export FSDP_BENCH_PERF_CTL="$ctl" FSDP_BENCH_PERF_ACK="$ack"
exec perf record -q -e cpu-clock -F 1000 -D -1 --control "fifo:$ctl,$ack" -o "$OUT/$TAG.rank$r.perf.data" -- "$@"
RANK
chmod +x "$work/rank.sh"

log "load average before: $(cut -d' ' -f1-3 /proc/loadavg) (2 cores)"
for rep in $(seq 1 "$repeat"); do
  for variant in fsdp local; do
    tag="$variant.$rep"
    if [ "$variant" = fsdp ]; then which=(--local 0 --fsdp 1); else which=(--local 1 --fsdp 0); fi
    log "run $rep: $variant (W=2, $steps measured steps)"
    env TMPDIR="$work" WORK="$work" OUT="$out" TAG="$tag" mpirun --oversubscribe --bind-to none -np 2 \
      -x OMP_NUM_THREADS -x MKL_NUM_THREADS -x WORK -x OUT -x TAG "$work/rank.sh" \
      "$bin" --init "$init" --out "$out/$tag.json" --models gpt "${which[@]}" --memory 0 \
      --flat-optimizer 0 --gpt-warmup 3 --gpt-steps "$steps" > "$work/$tag.log" 2>&1 ||
      { cat "$work/$tag.log" >&2; echo "profile_w2.sh: the $variant run failed" >&2; exit 1; }
  done
done
log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

"$FSDP_PYTHON" tools/bench/profile_report.py "$out" "$steps" | tee "$out/report.txt"
