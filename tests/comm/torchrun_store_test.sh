#!/usr/bin/env bash
# The real torchrun (the torch wheel's, `python -m torch.distributed.run --no-python`) launches
# torchrun_store_main, which rendezvouses through fsdp::comm::rendezvous_store and exchanges values:
#   1. recent torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True): every rank is a client;
#   2. without it (c10d rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): rank 0 serves MASTER_PORT;
#   3./4. mixed jobs, one rank in Python using torch.distributed's own env:// rendezvous (as a client
#      of the agent store; as rank 0 serving the store): C++ and Python ranks meet in the same keys.
# Every launch runs under a timeout on a free port; a failure prints the launch's whole output.
#   torchrun_store_test.sh PYTHON CPP_BINARY PY_WORKER MIXED_WRAPPER
set -u
py=$(realpath "$1"); binary=$(realpath "$2"); worker=$(realpath "$3"); wrapper=$(realpath "$4")
export OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdp_torchrun.XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0

free_port() {
  "$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

# launch NAME NPROC MODE PY_LOCAL_RANK  (PY_LOCAL_RANK -1: every rank is C++)
launch() {
  local name="$1" nproc="$2" mode="$3" py_rank="$4"
  local port; port=$(free_port)
  local rdzv=(--master-addr 127.0.0.1 --master-port "$port")
  local env_vars=()
  if [ "$mode" = rank0 ]; then
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "fsdp_$name")
    env_vars=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
  fi
  local program=("$binary")
  [ "$py_rank" -ge 0 ] && program=(bash "$wrapper" "$py_rank" "$py" "$worker" "$binary")
  local start; start=$(date +%s)
  env "${env_vars[@]}" timeout -k 10 120 "$py" -m torch.distributed.run --nproc-per-node "$nproc" \
    --max-restarts 0 --no-python "${rdzv[@]}" "${program[@]}" "$nproc" "$mode" > "$work/$name.txt" 2>&1
  local rc=$? problem=""
  local elapsed=$(( $(date +%s) - start ))
  local ok; ok=$(grep -c "rendezvous ok" "$work/$name.txt")
  [ $rc -eq 124 ] && problem="torchrun did not finish within the test's 120 s guard"
  [ $rc -ne 0 ] && [ -z "$problem" ] && problem="torchrun exited $rc"
  [ "$ok" -ne "$nproc" ] && problem="${problem:+$problem; }$ok of $nproc ranks reported a rendezvous"
  if [ "$py_rank" -ge 0 ] && ! grep -q "rank $py_rank/$nproc (python): rendezvous ok" "$work/$name.txt"; then
    problem="${problem:+$problem; }the Python rank did not finish"
  fi
  if [ -n "$problem" ]; then
    echo "=== FAILED: $name ($nproc ranks, $mode store): $problem; torchrun's output:"
    cat "$work/$name.txt"
    failures=$((failures + 1))
  else
    echo "=== passed: $name ($nproc ranks, $mode store) in ${elapsed} s"
    grep "rendezvous ok" "$work/$name.txt"
  fi
}

launch agent_store 2 agent -1
launch rank0_store 2 rank0 -1
launch mixed_agent_store 3 agent 1
launch mixed_python_rank0_serves 2 rank0 0
exit $failures
