#!/usr/bin/env bash
# fsdp::cp::ring_attention against PyTorch's ring attention on CPU/Gloo (cp = 2): torch writes its
# inputs and results (torch_ring_attention.py, which also shows that the public context_parallel
# API does not run on CPU and checks torch's ring against SDPA), then ring_attention_torch_main
# compares ours with them under mpirun -np 2.
# usage: ring_attention_torch_test.sh MAIN PYTHON TORCH_RING_ATTENTION_PY STEPS_SH
set -u
main="$1"; python="$2"; script="$3"
source "$4"

step "torch's ring attention on CPU/Gloo (2 processes) writes its inputs and results" \
  "$python" "$script" "$work/torch"
step "ring_attention at cp=2 equals torch's ring: layout, output and gradients (rtol/atol 1e-5)" \
  mpi 2 "$main" "$work/torch"
finish ring_attention_torch_test
