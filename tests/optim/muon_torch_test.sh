#!/usr/bin/env bash
# fsdp::optim::Muon on fully_shard models against torch.optim.Muon on the unsharded model:
# muon_torch_reference.py trains the model with torch's Muon (AdamW for the rest) and writes its
# inputs and results, then muon_torch_main runs the same five steps on 1, 2, 3 and 4 ranks and
# compares parameters, momentum buffers and losses (rtol/atol 1e-5).
# usage: muon_torch_test.sh MAIN PYTHON MUON_TORCH_REFERENCE_PY STEPS_SH
set -u
main="$1"; python="$2"; script="$3"
source "$4"

step "torch.optim.Muon on the unsharded model writes its inputs and results" "$python" "$script" "$work"
for n in 1 2 3 4; do
  step "fsdp::optim::Muon on $n rank(s) equals torch.optim.Muon (rtol/atol 1e-5)" mpi "$n" "$main" "$work"
done
finish muon_torch_test
