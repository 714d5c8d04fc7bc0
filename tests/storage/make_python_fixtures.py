"""Writes the safetensors files that tests/storage/safetensors_test.cc reads to check that the C++
reader understands files written by Python: one by the `safetensors` package (no checksums) and one
by torch.distributed.checkpoint's HuggingFaceStorageWriter (a sharded save, with its
DCP_SHARDING_INFO metadata). The values are closed-form (arange-based), so the C++ test checks them
without Python.

    python3 tests/storage/make_python_fixtures.py tests/storage/testdata
"""
import glob
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tensors = {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4,
        "f64": torch.arange(5, dtype=torch.float64) - 2.5,
        "f16": torch.arange(6, dtype=torch.float16).reshape(2, 3) / 2,
        "bf16": torch.arange(4, dtype=torch.bfloat16) * 3,
        "i64": torch.arange(6, dtype=torch.int64).reshape(3, 2) * -7,
        "i32": torch.arange(3, dtype=torch.int32) + 100,
        "i16": torch.arange(4, dtype=torch.int16) - 2,
        "i8": torch.arange(5, dtype=torch.int8) - 3,
        "u8": torch.arange(7, dtype=torch.uint8) * 30,
        "bool": torch.arange(5) % 2 == 0,
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
    }
    save_file(tensors, os.path.join(out_dir, "python_safetensors.safetensors"), metadata={"format": "pt"})

    # torch.distributed.checkpoint's Hugging Face layout, one process standing for rank 0.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    with tempfile.TemporaryDirectory() as tmp:
        state = {"layer.weight": torch.arange(20, dtype=torch.float32).reshape(4, 5),
                 "layer.bias": torch.arange(4, dtype=torch.float32) * 0.5}
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(tmp, save_distributed=True), no_dist=True)
        files = sorted(glob.glob(os.path.join(tmp, "*.safetensors")))
        assert len(files) == 1, files
        shutil.copyfile(files[0], os.path.join(out_dir, "dcp_hf_shard.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
