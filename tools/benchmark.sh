#!/usr/bin/env bash
# Benchmarks fully_shard against plain local training and against PyTorch's own FSDP (FSDP2
# fully_shard and FSDP1 FullyShardedDataParallel, CPU + Gloo, from the installed torch), side by
# side in one run: step time and overhead per unit per step at world size 1, step time at world
# size 2 (against the W=1 local step and against two local trainings at once, the concurrent-local
# reference), per-rank memory counted by a CPU allocator (the peak over a whole training step for local
# training and for fully_shard against the ZeRO-3 expectation, and the steady state), and bytes
# communicated per step, each against its formula. Prints the tables, writes JSON and renders a PNG
# chart (tools/bench/README.md says what each figure measures), the checkpoint benchmark's summary
# (tools/checkpoint_benchmark.sh) and Muon's step times (tools/muon_benchmark.sh) before them, and
# the targets (checkpoint load, Muon and bfloat16-moment rows included) last.
#
#   tools/benchmark.sh [--out PATH.json] [--quick]
#
#   --out PATH.json   where the merged results go (default tools/bench/out/results.json); the PNG
#                     goes next to it (same name, .png), the programs' raw JSON into its folder
#   --quick           fewer steps (a smoke run; medians are noisier)
#
# Runs tools/setup.sh --bench first (the README's set-up, and matplotlib in the benchmarks' own Python
# environment, tools/requirements-bench.txt). Every process runs one intra-op thread (the machine has 2 cores).
# The C++ program is built with -c opt and without Bazel's convenience symlinks (so bazel-bin keeps
# pointing wherever the last ordinary build left it).
set -euo pipefail
cd "$(dirname "$0")/.."

out=tools/bench/out/results.json
quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --quick) quick=1; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "benchmark.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
outdir=$(dirname "$out")
png="${out%.json}.png"
mkdir -p "$outdir"

log() { echo "[benchmark] $*" >&2; }

# Whether a phase ran on a quiet machine: the CPU time every process used while it ran (/proc/stat)
# against the CPU time of the phase's own processes (the shell's children, `times`). What the
# phase's processes do not explain was used by something else beside it; a phase where that is
# more than 10% of one core over its wall time is marked BUSY in the report, with the figures.
cpu_total() { awk '/^cpu / { print ($2 + $3 + $4 + $7 + $8 + $9) / 100 }' /proc/stat; }  # seconds
# `times` must run in this shell (in a command substitution it would report the subshell's children).
own_cpu() {  # own_cpu FILE: this shell's children's CPU seconds into FILE
  times > "$1"
  tail -n 1 "$1" | awk '{ gsub(/[ms]/, " "); print $1 * 60 + $2 + $3 * 60 + $4 }' > "$1.s"
}
load_notes=""
phase() {  # phase NAME COMMAND...: runs COMMAND, notes whether something else ran beside it
  local name=$1; shift
  local t0 c0 o0 t1 c1 o1
  local tf="${work:-/tmp}/phase_times"
  own_cpu "$tf"; o0=$(cat "$tf.s"); t0=$(date +%s.%N); c0=$(cpu_total)
  "$@"
  t1=$(date +%s.%N); c1=$(cpu_total); own_cpu "$tf"; o1=$(cat "$tf.s")
  local line
  line=$(awk -v n="$name" -v t0="$t0" -v t1="$t1" -v c0="$c0" -v c1="$c1" -v o0="$o0" -v o1="$o1" \
             -v la="$(cut -d' ' -f1 /proc/loadavg)" 'BEGIN {
    w = t1 - t0; all = c1 - c0; own = o1 - o0; other = all - own; if (other < 0) other = 0;
    printf "%s %s: wall %.1f s, its processes %.1f CPU-s, others %.1f CPU-s (%.0f%% of a core), load average %s\n",
      (other > 0.1 * w ? "BUSY" : "quiet"), n, w, own, other, 100 * other / w, la }')
  log "$line"
  load_notes+="$line"$'\n'
}

# --- set-up: the README's, plus the benchmarks' Python environment (matplotlib, layered on the
# test environment so that one keeps holding exactly tools/requirements.txt)
tools/setup.sh --bench >&2
. tools/python_env.sh
py="$FSDP_BENCH_PYTHON"

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A short TMPDIR: Open MPI's session directory holds Unix sockets, whose paths are limited.
work=$(mktemp -d /tmp/fsdpb.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- build
log "building //tools/bench:fsdp_bench (-c opt)"
if ! bazel build -c opt --symlink_prefix=/ //tools/bench:fsdp_bench >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "benchmark.sh: the build failed" >&2
  exit 1
fi
bin="$(bazel info -c opt --symlink_prefix=/ bazel-bin 2>/dev/null)/tools/bench/fsdp_bench"
[ -x "$bin" ] || { echo "benchmark.sh: $bin was not built" >&2; exit 1; }

if [ "$quick" = 1 ]; then
  cpp_steps=(--warmup 3 --steps 10 --gpt-warmup 1 --gpt-steps 5)
  cpp2_steps=(--warmup 3 --steps 10 --gpt-warmup 1 --gpt-steps 4)
  py1_steps=(--warmup 3 --steps 10 --gpt-warmup 1 --gpt-steps 5)
  py2_steps=(--warmup 2 --steps 6 --gpt-warmup 1 --gpt-steps 4)
else
  cpp_steps=(--warmup 10 --steps 40 --gpt-warmup 3 --gpt-steps 30)
  cpp2_steps=(--warmup 5 --steps 30 --gpt-warmup 2 --gpt-steps 12)
  py1_steps=(--warmup 5 --steps 30 --gpt-warmup 2 --gpt-steps 15)
  py2_steps=(--warmup 5 --steps 15 --gpt-warmup 2 --gpt-steps 10)
fi
init="$outdir/init.pt"
rm -f "$outdir"/cpp_w1.json "$outdir"/cpp_w2.json "$outdir"/py_w1.json "$outdir"/py_w2.json \
      "$outdir"/py_check.json "$outdir"/checkpoint.txt

start=$SECONDS
log "load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg) (2 cores, shared)"
log "weights and data for both sides -> $init"
"$bin" --write-init "$init" >&2

log "PyTorch FSDP2 / FSDP1 on the CPU with Gloo: checking they run"
"$py" tools/bench/torch_bench.py --check --out "$outdir/py_check.json" >&2

log "this project, world size 1 (plain run): local vs fully_shard"
phase "this project W=1" "$bin" --init "$init" --out "$outdir/cpp_w1.json" "${cpp_steps[@]}"

# With local training beside fully_shard, steps interleaved: the concurrent-local reference (each
# process trains its own copy on its own batches, both at once, no communication), so the W=2 step's
# gap to the W=1 local step splits into what the machine costs and what the library costs.
log "this project, world size 2 (mpirun -np 2): fully_shard, and local training in both processes at once"
phase "this project W=2" env TMPDIR="$work" mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS \
  -x MKL_NUM_THREADS "$bin" --init "$init" --out "$outdir/cpp_w2.json" --local 1 "${cpp2_steps[@]}"

log "PyTorch, world size 1: local, FSDP2, FSDP1"
phase "PyTorch W=1" "$py" tools/bench/torch_bench.py --init "$init" --out "$outdir/py_w1.json" --world 1 \
  --variants local,fsdp2,fsdp1 "${py1_steps[@]}"

log "PyTorch, world size 2 (2 processes, Gloo): FSDP2, FSDP1"
phase "PyTorch W=2" "$py" tools/bench/torch_bench.py --init "$init" --out "$outdir/py_w2.json" --world 2 \
  --variants fsdp2,fsdp1 "${py2_steps[@]}"

log "runs took $((SECONDS - start)) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Checkpoints: fsdp::dcp save/load throughput and memory against dd and Python DCP (its own table,
# printed here; report.py reads its summary for the load targets, so it runs before the report).
log "checkpoints: tools/checkpoint_benchmark.sh -> $outdir/checkpoint.txt"
if ! tools/checkpoint_benchmark.sh --repeats "$([ "$quick" = 1 ] && echo 1 || echo 3)" --out "$outdir/checkpoint.txt"; then
  log "the checkpoint benchmark failed: its targets are reported as not run"
  rm -f "$outdir/checkpoint.txt"
fi

# replicate against fully_shard NO_SHARD on the example GPT at world size 2 (its own lines).
log "replicate vs NO_SHARD: tools/replicate_benchmark.sh -> $outdir/replicate.txt"
tools/replicate_benchmark.sh --steps "$([ "$quick" = 1 ] && echo 8 || echo 30)" | tee "$outdir/replicate.txt"

# fsdp::optim::Muon against every rank orthogonalizing everything and torch.optim.Muon (its own lines).
log "Muon: tools/muon_benchmark.sh -> $outdir/muon.json"
rm -f "$outdir/muon.json"
if ! tools/muon_benchmark.sh --out "$outdir/muon.json" --steps "$([ "$quick" = 1 ] && echo 4 || echo 10)"; then
  log "the Muon benchmark failed: its targets are reported as not run"
fi

# The tables and the targets last (the checkpoint and Muon rows from their summaries).
"$py" tools/bench/report.py --dir "$outdir" --out "$out" --png "$png" --checkpoint "$outdir/checkpoint.txt" \
  --muon "$outdir/muon.json"
echo "== machine load during each run (figures of a BUSY run were taken beside other work) =="
printf '%s' "$load_notes" | tee "$outdir/load.txt"
if grep -q '^BUSY' "$outdir/load.txt"; then
  echo "WARNING: some figures above were taken while other processes used the CPU (BUSY lines): rerun on a quiet machine"
fi
