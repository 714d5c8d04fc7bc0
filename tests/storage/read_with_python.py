"""Checks that Python's `safetensors` package reads a file written by the C++ writer
(storage/safetensors.h): every tensor of `expected.json` is present with the expected dtype, shape
and values, and the file's metadata holds the given pairs.

    python3 tests/storage/read_with_python.py FILE.safetensors EXPECTED.json [KEY=VALUE ...]

EXPECTED.json maps each key to {"dtype": c10 dtype name ("Float", "BFloat16", ...), "shape": [...],
"values": [flat row-major values as numbers; complex as (re, im) pairs]}. Exits non-zero, printing
every mismatch, if anything differs.
"""
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

C10_DTYPES = {
    "Double": torch.float64, "Float": torch.float32, "Half": torch.float16, "BFloat16": torch.bfloat16,
    "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
    "Bool": torch.bool, "UInt16": torch.uint16, "UInt32": torch.uint32, "UInt64": torch.uint64,
    "ComplexFloat": torch.complex64, "Float8_e4m3fn": torch.float8_e4m3fn, "Float8_e5m2": torch.float8_e5m2,
}


def main(argv: list[str]) -> int:
    path, expected_path, pairs = argv[1], argv[2], argv[3:]
    with open(expected_path) as f:
        expected = json.load(f)
    tensors = load_file(path)
    errors = []
    if set(tensors) != set(expected):
        errors.append(f"keys differ: file has {sorted(tensors)}, expected {sorted(expected)}")
    for key, spec in expected.items():
        if key not in tensors:
            continue
        t = tensors[key]
        dtype = C10_DTYPES[spec["dtype"]]
        if t.dtype != dtype:
            errors.append(f"{key}: dtype {t.dtype}, expected {dtype}")
            continue
        if list(t.shape) != spec["shape"]:
            errors.append(f"{key}: shape {list(t.shape)}, expected {spec['shape']}")
            continue
        real = torch.view_as_real(t) if t.is_complex() else t
        values = real.to(torch.float64).reshape(-1)
        want = torch.tensor(spec["values"], dtype=torch.float64)
        if values.shape != want.shape or not torch.equal(values, want):
            errors.append(f"{key}: values {values.tolist()}, expected {want.tolist()}")
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    for pair in pairs:
        k, v = pair.split("=", 1)
        if metadata.get(k) != v:
            errors.append(f"metadata {k!r} is {metadata.get(k)!r}, expected {v!r}")
    for e in errors:
        print(f"{path}: {e}", file=sys.stderr)
    if not errors:
        print(f"{path}: {len(expected)} tensors read by safetensors {__import__('safetensors').__version__} match")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
