#!/usr/bin/env bash
# Checkpoints cross the language boundary both ways (PyTorch from the torch package, safetensors):
#   - written here on 2 and 3 ranks (fsdp::dcp::save), read in Python by
#     torch.distributed.checkpoint.load with HuggingFaceStorageReader into full-shape tensors, equal
#     to this library's full state dict, itself exported as model.safetensors (read by
#     safetensors.torch.load_file), as model-0000k-of-0000n.safetensors + index, and as .pt
#     (read by torch.load);
#   - written by PyTorch's FSDP2 + DCP with HuggingFaceStorageWriter (CPU, Gloo, 2 processes),
#     loaded here on 1, 3 and 4 ranks, equal to PyTorch's full state dict.
# usage: interop_test.sh INTEROP_MAIN PYTHON DCP_READ_PY FSDP2_WRITE_PY CHECK_EXPORT_PY
set -u
main="$1"; python="$2"; dcp_read="$3"; fsdp2_write="$4"; check_export="$5"
source "$(dirname "$0")/steps.sh"

for n in 2 3; do
  out="$work/cpp_w$n"
  step "save on $n ranks (fsdp::dcp::save + full exports)" mpi "$n" "$main" write "$out"
  step "Python DCP HuggingFaceStorageReader reads the $n-rank checkpoint" \
    "$python" "$dcp_read" "$out/ckpt" "$out/full/model.safetensors"
  step "safetensors.torch.load_file reads model.safetensors ($n ranks)" \
    "$python" "$check_export" "$out/full" "$out/full/model.safetensors"
  step "Python reads model-0000k-of-0000n.safetensors + index ($n ranks)" \
    "$python" "$check_export" "$out/full_split" "$out/full/model.safetensors"
  step "torch.load reads the .pt ($n ranks)" \
    "$python" "$check_export" "$out/full.pt" "$out/full/model.safetensors"
done

py="$work/fsdp2"
step "PyTorch FSDP2 + DCP HuggingFaceStorageWriter saves on 2 processes" \
  "$python" "$fsdp2_write" "$py" --world-size 2
for n in 1 3 4; do
  step "FSDP2's checkpoint loads here on $n rank(s)" mpi "$n" "$main" read "$py/ckpt" "$py/reference.safetensors"
done
finish interop_test
