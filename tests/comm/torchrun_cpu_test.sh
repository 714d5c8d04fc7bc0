#!/usr/bin/env bash
# The real torchrun launching a CPU job on 2 ranks ([Note: CPU jobs under torchrun] in comm/init.cc):
# every rank prints why it cannot run and exits 1; no abort(), no C++ trace.
#   torchrun_cpu_test.sh PYTHON BINARY
set -u
py=$(realpath "$1"); binary=$(realpath "$2")
export OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdp_torchrun_cpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
# --monitor-interval 10: torchrun looks at its workers every 10 s, so both have printed and exited
# before it sees the first failure and stops the other (at the default 0.1 s a rank slow to load
# LibTorch on a busy machine could be stopped before it printed).
timeout -k 10 120 "$py" -m torch.distributed.run --nproc-per-node 2 --max-restarts 0 --no-python \
  --monitor-interval 10 \
  --master-addr 127.0.0.1 --master-port "$port" "$binary" > "$work/out.txt" 2>&1
rc=$?
cat "$work/out.txt"
problems=()
[ $rc -eq 0 ] && problems+=("torchrun exited 0")
[ $rc -eq 124 ] && problems+=("torchrun did not finish within 120 s")
for r in 0 1; do
  grep -qF "[fsdp comm] rank $r of 2: fsdp::comm::init_process_group: this CPU job was launched by torchrun" "$work/out.txt" ||
    problems+=("rank $r did not explain")
done
grep -qF 'Launch CPU jobs with `mpirun -np 2 ...`' "$work/out.txt" || problems+=("no mpirun advice")
# torchrun's summary gives each rank's exit code: 1, not a signal.
grep -q "exitcode *: 1 " "$work/out.txt" || problems+=("no rank exited with status 1")
for bad in "terminate called" "Exception raised from" "SIGABRT" "Signal 6" "returned on the CPU"; do
  grep -qF "$bad" "$work/out.txt" && problems+=("'$bad' in the output")
done
if [ ${#problems[@]} -gt 0 ]; then
  for p in "${problems[@]}"; do echo "FAILED: $p"; done
  exit 1
fi
echo "PASSED: torchrun's CPU job ended with the explanation and status 1 on every rank"
