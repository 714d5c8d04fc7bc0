#!/usr/bin/env bash
# Checkpoint throughput and memory (tools/benchmark.sh calls it; runs alone too): fsdp::dcp save and
# load of a ~300 MB model on 1 and 2 ranks, next to, measured in the same run on the same folder:
#   - the disk's sequential write (dd with conv=fdatasync: data on disk, as a save's fsync) and read
#     bandwidth (dd after dropping the page cache, and again with the file cached);
#   - Python torch.distributed.checkpoint's save/load of the same bytes (FileSystemWriter, and
#     HuggingFaceStorageWriter).
# Loads are measured cold (page cache dropped, when this user may: root) and warm.
#
#   tools/checkpoint_benchmark.sh [--size-mb 300] [--dir DIR] [--repeats 3] [--out FILE] [--bin FILE]
#
# --bin: a checkpoint_bench already built (e.g. a copy of an earlier commit's, to compare two
# versions under the same conditions) instead of building //tools/bench:checkpoint_bench.
# DIR (default: a fresh folder under /var/tmp, on the disk rather than a tmpfs) is removed after.
# The 1-minute load average is recorded before and after each group of measurements; the report
# marks a group during which it was above 2.5 (the benchmark runs at most 2 busy processes, so
# more means other work shared the CPUs and the figures are lower than the machine's).
set -euo pipefail
cd "$(dirname "$0")/.."
size_mb=300; dir=""; repeats=3; out=""; bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --size-mb) size_mb="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --repeats) repeats="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "checkpoint_benchmark.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
log() { echo "[checkpoint-benchmark] $*" >&2; }
tools/setup.sh --bench >&2
. tools/python_env.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d /tmp/fsdpk.XXXXXX)
[ -n "$dir" ] || dir=$(mktemp -d /var/tmp/fsdp_ckpt_bench.XXXXXX)
mkdir -p "$dir"
trap 'rm -rf "$work" "$dir"' EXIT
results="$work/results.txt"

if [ -z "$bin" ]; then
  log "building //tools/bench:checkpoint_bench (-c opt)"
  if ! bazel build -c opt --symlink_prefix=/ //tools/bench:checkpoint_bench >"$work/build.log" 2>&1; then
    cat "$work/build.log" >&2; exit 1
  fi
  bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/checkpoint_bench"
else
  bin="$(realpath "$bin")"
  log "using $bin"
fi

drop_caches() { sync; { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; }
# dd's last line: "... bytes ... copied, S s, R GB/s"; prints GB/s (decimal) from bytes / seconds.
dd_rate() { awk '/copied/ { for (i = 1; i <= NF; ++i) if ($i == "bytes") b = $(i-1); s = $(NF-3); gsub(",", "", s); printf "%.3f", b / s / 1e9 }'; }
loadavg() { cut -d' ' -f1 /proc/loadavg; }
# "load <group> before=<1-min load average> after=<...>" (checkpoint_report.py marks loaded groups).
count=$((size_mb / 4))
before=$(loadavg)
for r in $(seq "$repeats"); do
  w=$(dd if=/dev/zero of="$dir/dd.bin" bs=4M count="$count" conv=fdatasync 2>&1 | dd_rate)
  echo "disk write(dd,fdatasync) GB/s=$w" | tee -a "$results"
  if drop_caches; then
    rc=$(dd if="$dir/dd.bin" of=/dev/null bs=4M 2>&1 | dd_rate)
    echo "disk read(dd, cold) GB/s=$rc" | tee -a "$results"
  fi
  rw=$(dd if="$dir/dd.bin" of=/dev/null bs=4M 2>&1 | dd_rate)
  echo "disk read(dd, page cache warm) GB/s=$rw" | tee -a "$results"
done
rm -f "$dir/dd.bin"
echo "load disk before=$before after=$(loadavg)" | tee -a "$results"

for n in 1 2; do
  log "fsdp::dcp on $n rank(s)"
  before=$(loadavg)
  TMPDIR="$work" mpirun --oversubscribe --bind-to none -np "$n" -x OMP_NUM_THREADS -x MKL_NUM_THREADS \
    "$bin" --dir "$dir/fsdp_w$n" --size-mb "$size_mb" --repeats "$repeats" | tee -a "$results"
  echo "load fsdp_dcp W=$n before=$before after=$(loadavg)" | tee -a "$results"
  rm -rf "$dir/fsdp_w$n"
done
for n in 1 2; do
  log "Python DCP on $n process(es)"
  before=$(loadavg)
  "$FSDP_BENCH_PYTHON" tools/bench/python_dcp_bench.py --size-mb "$size_mb" --dir "$dir/py_w$n" --world-size "$n" \
    --repeats "$repeats" | tee -a "$results"
  echo "load python_dcp W=$n before=$before after=$(loadavg)" | tee -a "$results"
  rm -rf "$dir/py_w$n"
done
"$FSDP_BENCH_PYTHON" tools/bench/checkpoint_report.py "$results" | tee "${out:-/dev/null}"
