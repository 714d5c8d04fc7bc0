#!/usr/bin/env python3
"""Checks a full (unsharded) export of named tensors against a reference safetensors file:

    check_full_export.py EXPORT REFERENCE.safetensors [--strict-keys]

EXPORT is one of
  * a safetensors file (any name, e.g. model.safetensors): one JSON header, every entry a full
    tensor; read with safetensors.torch.load_file;
  * a folder holding `model.safetensors.index.json` (the Hugging Face convention:
    {"metadata": {"total_size": N}, "weight_map": {key: "model-0000k-of-0000n.safetensors"}}) and the
    files it names: each key is read from the file the index maps it to, and must be there; every
    file the index names must exist; metadata.total_size, when given, must equal the bytes of
    tensor data of the files (sum over entries of data_offsets[1] - data_offsets[0]);
  * a folder holding `model.safetensors` alone (no index): that file;
  * a `.pt` file written by LibTorch's `torch::pickle_save` of a `c10::Dict<std::string, at::Tensor>`
    (a zip archive `archive/data.pkl` + `archive/data/<n>`, the dict's type tagged by
    torch.jit._pickle.restore_type_tag), or by Python's torch.save of a dict of tensors; read with
    `torch.load(weights_only=True)` allowing that one type-tag function.
Every reference key must be in the export with the same dtype, shape and bits. Keys the reference
lacks are listed (and fail with --strict-keys). Exit 0 when everything matches; 1 with a message
naming the first mismatching (or the missing) key otherwise; 2 for bad arguments or unreadable files.
"""

import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_util import first_difference  # noqa: E402
from safetensors_header import read_header  # noqa: E402

warnings.filterwarnings("ignore")

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class ExportError(Exception):
    pass


def load_pt(path):
    import torch.jit._pickle

    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        obj = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in obj.items()):
        raise ExportError(f"{path}: not a dict of str -> Tensor but {type(obj).__name__}")
    return dict(obj)


def load_indexed(folder):
    from safetensors import safe_open

    with open(os.path.join(folder, INDEX_NAME)) as f:
        index = json.load(f)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(f"{INDEX_NAME}: no weight_map")
    files = sorted(set(weight_map.values()))
    for name in files:
        if not os.path.isfile(os.path.join(folder, name)):
            raise ExportError(f"{INDEX_NAME} names {name}, which does not exist")
    data_bytes = 0
    for name in files:
        entries, _ = read_header(os.path.join(folder, name))
        data_bytes += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries.values())
    total = (index.get("metadata") or {}).get("total_size")
    if total is not None and int(total) != data_bytes:
        raise ExportError(f"{INDEX_NAME}: metadata.total_size {total}, the files hold {data_bytes} bytes of data")
    out = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            present = set(f.keys())
            for key, file_name in weight_map.items():
                if file_name != name:
                    continue
                if key not in present:
                    raise ExportError(f"{INDEX_NAME} maps {key} to {name}, which lacks it")
                out[key] = f.get_tensor(key)
    return out


def load_export(path):
    """{key: tensor} of an export in any of the formats above, and a word on which it was."""
    from safetensors.torch import load_file

    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return load_indexed(path), f"index {INDEX_NAME}"
        if os.path.isfile(os.path.join(path, SINGLE_NAME)):
            return load_file(os.path.join(path, SINGLE_NAME)), SINGLE_NAME
        raise ExportError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} in it")
    if not os.path.isfile(path):
        raise ExportError(f"{path}: no such file or folder")
    if path.endswith(".safetensors"):
        return load_file(path), "safetensors file"
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"PK":
        return load_pt(path), "pickle (zip) file"
    # No known suffix and not a zip: try safetensors.
    return load_file(path), "safetensors file"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export")
    p.add_argument("reference")
    p.add_argument("--strict-keys", action="store_true", help="fail when the export has keys the reference lacks")
    args = p.parse_args()
    from safetensors.torch import load_file

    try:
        reference = load_file(args.reference)
        got, kind = load_export(args.export)
    except ExportError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # unreadable file
        print(f"FAIL: cannot read: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"export {args.export} ({kind}): {len(got)} keys; reference {len(reference)} keys")
    missing = [k for k in reference if k not in got]
    if missing:
        print(f"FAIL: the export lacks {len(missing)} reference keys: {missing}", file=sys.stderr)
        return 1
    extra = sorted(set(got) - set(reference))
    if extra:
        print(f"  keys not in the reference ({len(extra)}): {extra}")
        if args.strict_keys:
            print(f"FAIL: --strict-keys and {len(extra)} keys not in the reference", file=sys.stderr)
            return 1
    for key, ref in reference.items():
        d = first_difference(got[key], ref)
        if d:
            print(f"FAIL: {key}: {d}", file=sys.stderr)
            return 1
    print(f"OK: {len(reference)} reference keys match bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
