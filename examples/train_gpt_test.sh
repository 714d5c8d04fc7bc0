#!/usr/bin/env bash
# The example end to end on 2 ranks with activation checkpointing and the profiler: it prints the
# sharding plan, samples the same text on every rank after training, agrees with its unsharded
# reference, and writes a Chrome trace holding the library's scopes (FSDP::pre_forward,
# FSDP::all_gather, FSDP::reduce_scatter, checkpoint::recompute).
set -u
train="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpe.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
fail() { echo "FAILED: $*"; exit 1; }
timeout 600 mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS "$train" --steps 5 --layers 2 \
  --d-model 64 --context 32 --batch 4 --checkpoint-activations --profile "$work/trace.json" > "$work/out.log" 2>&1
rc=$?
cat "$work/out.log"
[ $rc -eq 0 ] || fail "train_gpt exited with $rc"
grep -q "FSDP sharding plan: 3 units on 2 ranks" "$work/out.log" || fail "no sharding plan printed"
grep -q "activation checkpointing on each block" "$work/out.log" || fail "checkpointing not reported"
grep -q "agree within" "$work/out.log" || fail "no agreement with the unsharded reference"
# Sampling after training: GPT::generate through the root's hooks, the same text on every rank.
grep -q "^sample from the sharded model (greedy; 80 characters after the prompt, .*, the same on every rank):" \
  "$work/out.log" || fail "no sample from the sharded model (or not the same on every rank)"
grep -A1 "^sample from the sharded model" "$work/out.log" | tail -n 1 | grep -q "^The keeper " \
  || fail "the sample does not continue the prompt"
[ -s "$work/trace.json" ] || fail "no trace written"
python3 - "$work/trace.json" <<'PY' || fail "trace check"
import json, sys
trace = json.load(open(sys.argv[1]))
names = {e.get("name") for e in trace.get("traceEvents", [])}
wanted = ["FSDP::pre_forward", "FSDP::post_forward", "FSDP::all_gather", "FSDP::pre_backward",
          "FSDP::post_backward", "FSDP::reduce_scatter", "FSDP::post_backward_final_callback",
          "checkpoint::recompute"]
missing = [w for w in wanted if w not in names]
print("trace: %d events; scopes found: %s" % (len(trace.get("traceEvents", [])), ", ".join(w for w in wanted if w in names)))
if missing:
    print("missing scopes:", missing)
    sys.exit(1)
PY
echo "PASSED"
