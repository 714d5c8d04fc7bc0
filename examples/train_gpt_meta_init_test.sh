#!/usr/bin/env bash
# Models larger than one host, end to end with the example: export trained weights (safetensors),
# then build the GPT on the meta device (--meta-init), let fully_shard materialize only the shards
# and load the weights straight into them (--init-from), on 1-4 ranks: training must agree with the
# unsharded reference loaded from the same file, and with 2+ ranks rank 0 must read less than the
# whole model. Also --meta-init alone (values from the recorded construction) on 3 ranks.
set -u
train="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpm.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
fail() { echo "FAILED: $*"; exit 1; }
small=(--layers 2 --d-model 64 --context 32 --batch 4)
run() {  # run NP LOG ARGS...
  local np=$1 log=$2
  shift 2
  timeout 300 mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS "$train" "${small[@]}" "$@" > "$log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { cat "$log"; fail "train_gpt -np $np $* exited with $rc"; }
}
run 2 "$work/export.log" --steps 3 --check-unsharded 0 --export "$work/pretrained"
grep -q "exported the weights after step 3" "$work/export.log" || { cat "$work/export.log"; fail "no export"; }
[ -s "$work/pretrained/model.safetensors" ] || fail "no model.safetensors written"
for np in 1 2 3 4; do
  log="$work/load$np.log"
  run "$np" "$log" --steps 3 --seed 5 --meta-init --init-from "$work/pretrained/model.safetensors"
  grep "loaded .* into the shards\|agree within\|relative difference" "$log" | sed "s/^/[np $np] /"
  grep -q "agree within" "$log" || { cat "$log"; fail "np $np: no agreement with the unsharded reference loaded from the same file"; }
  read -r got total < <(sed -n 's/.*rank 0 read \([0-9]*\) of the model.s \([0-9]*\) bytes.*/\1 \2/p' "$log")
  [ -n "${got:-}" ] || fail "np $np: no bytes-read line"
  if [ "$np" -gt 1 ] && [ "$got" -ge "$total" ]; then fail "np $np: rank 0 read $got of $total bytes (the whole model)"; fi
done
run 3 "$work/meta.log" --steps 3 --meta-init
grep -q "agree within" "$work/meta.log" || { cat "$work/meta.log"; fail "--meta-init: no agreement with the unsharded reference"; }
grep "agree within" "$work/meta.log" | sed "s/^/[--meta-init np 3] /"
echo "PASSED"
