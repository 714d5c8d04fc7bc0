#!/usr/bin/env bash
# Quantized communication on the example (docs/quantized_communication.md): 2 ranks, 60 steps
# with int8 all-gathers and gradient reductions (--quantize-weights --quantize-grads, blocks of
# 256, float32 scales); the final loss must stay within the stated tolerance (a relative 2e-2) of
# the full-precision unsharded reference, which train_gpt checks itself (exit 1 otherwise), and
# the collectives must be the encoded ones: all-to-alls instead of reduce-scatters, all-gathers of
# int8 bytes.
set -u
train="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpq.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
fail() { echo "FAILED: $*"; exit 1; }
timeout 900 mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS "$train" --steps 60 --sample 0 \
  --quantize-weights --quantize-grads > "$work/out.log" 2>&1
rc=$?
cat "$work/out.log"
[ $rc -eq 0 ] || fail "train_gpt exited with $rc (a final loss outside the tolerance exits 1)"
grep -q "quantized communication: all-gathers gradient reductions in int8_block(256, Float scales)" "$work/out.log" \
  || fail "quantization not reported"
grep -q "agree within 2e-02" "$work/out.log" || fail "no agreement with the full-precision reference within 2e-2"
# The measured collectives per step (calls with two decimals), not the plan's rows.
grep -Eq "^  all_to_all_single +5\.00 " "$work/out.log" || fail "no all-to-all of encoded gradients"
grep -Eq "^  reduce_scatter_tensor +[0-9]+\.[0-9]{2} " "$work/out.log" && fail "gradients were reduce-scattered unencoded"
echo "PASSED"
