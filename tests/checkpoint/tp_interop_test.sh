#!/usr/bin/env bash
# Tensor-parallel checkpoints cross the language boundary both ways (torch, safetensors), on the
# example GPT with the same FQNs in both languages:
#   - PyTorch FSDP2 + DTensor TP (init_device_mesh("cpu", (dp, tp)), ColwiseParallel /
#     RowwiseParallel, Gloo) saves with HuggingFaceStorageWriter at (dp, tp) = (2, 2); loaded here
#     at (1, 2), (1, 4), (4, 1) and (1, 3) (3 ranks), equal to PyTorch's values;
#   - saved here at (1, 2) (fsdp::dcp::save, fused qkv pieces as 3 boxes per rank), read by PyTorch
#     FSDP2 + TP at (2, 1), (1, 4) and (2, 2), equal to this library's full state dict.
# usage: tp_interop_test.sh TP_INTEROP_MAIN PYTHON FSDP2_TP_PY
set -u
main="$1"; python="$2"; fsdp2_tp="$3"
source "$(dirname "$0")/steps.sh"

py="$work/py"
step "PyTorch FSDP2 + TP saves at (dp, tp) = (2, 2) with HuggingFaceStorageWriter" \
  "$python" "$fsdp2_tp" write "$py" --dp 2 --tp 2
for layout in "1 2" "1 4" "4 1" "1 3"; do
  set -- $layout
  step "PyTorch's (2, 2) checkpoint loads here at (dp, tp) = ($1, $2)" \
    mpi $(($1 * $2)) "$main" load "$py/ckpt" "$py/reference.safetensors" "$1" "$2"
done

cpp="$work/cpp"
step "saved here at (dp, tp) = (1, 2)" mpi 2 "$main" save "$cpp" 1 2 5
for layout in "2 1" "1 4" "2 2"; do
  set -- $layout
  step "PyTorch FSDP2 + TP reads this library's (1, 2) checkpoint at (dp, tp) = ($1, $2)" \
    "$python" "$fsdp2_tp" read "$cpp/ckpt" "$cpp/full/model.safetensors" --dp "$1" --tp "$2"
done
finish tp_interop_test
