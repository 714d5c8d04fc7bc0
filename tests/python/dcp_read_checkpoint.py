#!/usr/bin/env python3
"""Checks a sharded checkpoint in the layout of torch.distributed.checkpoint's Hugging Face storage
against the full values it must hold:

    dcp_read_checkpoint.py CKPT_DIR REFERENCE.safetensors

CKPT_DIR holds `*.safetensors` files (one or more per rank, e.g. shard-00001-model-00001-of-00001
.safetensors), each entry a box of a global tensor that starts at the `saved_offsets` given for its
key in the file's __metadata__ DCP_SHARDING_INFO (JSON {key: {"saved_offsets": [...]}}; an entry
without it starts at 0). REFERENCE.safetensors holds full tensors.

For the reference's keys (by default only those), the script
  1. reads every file's header and fails, listing them, when keys are missing; fails when an entry's
     dtype differs from the reference's or its box leaves the reference's shape;
  2. loads the checkpoint with `torch.distributed.checkpoint.load(state_dict,
     storage_reader=HuggingFaceStorageReader(CKPT_DIR))` into zero tensors of the reference's shapes
     and dtypes, in this one process without a process group, and compares bit for bit;
  3. independently assembles each tensor from the boxes with safetensors' safe_open, checking that
     the boxes cover every element, and compares bit for bit.
Other entries (optimizer state `state.<fqn>.<name>`, `param_groups.<fqn>.<name>`, user entries
`extra.<name>`, anything else) and files that are not safetensors (e.g. fsdp_checkpoint.json) are
listed, not compared. Exit 0 when everything matches; 1 with a message naming the first
mismatching key (or the missing keys) otherwise; 2 for bad arguments.
"""

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_util import first_difference  # noqa: E402
from safetensors_header import read_header, sharding_info  # noqa: E402

warnings.filterwarnings("ignore")

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def scan(ckpt_dir):
    """({key: [(file, dtype string, shape, offsets)]}, [names of other files])."""
    boxes, others = {}, []
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if not name.endswith(".safetensors") or not os.path.isfile(path):
            others.append(name)
            continue
        entries, metadata = read_header(path)
        info = sharding_info(metadata) or {}
        for key, e in entries.items():
            offsets = info.get(key, [0] * len(e["shape"]))
            boxes.setdefault(key, []).append((path, e["dtype"], list(e["shape"]), list(offsets)))
    return boxes, others


def group_of(key):
    for prefix in ("state.", "param_groups.", "extra."):
        if key.startswith(prefix):
            return prefix[:-1]
    return "other"


def check_boxes(key, boxes, ref):
    """None, or why the boxes of `key` do not fit the reference tensor."""
    for path, dtype, shape, offsets in boxes:
        name = os.path.basename(path)
        if SAFETENSORS_DTYPES.get(dtype) != ref.dtype:
            return f"{name}: dtype {dtype}, reference {ref.dtype}"
        if len(shape) != ref.dim() or len(offsets) != ref.dim():
            return f"{name}: shape {shape} offsets {offsets} for a {ref.dim()}-d reference"
        for d, (o, s) in enumerate(zip(offsets, shape)):
            if o < 0 or o + s > ref.shape[d]:
                return f"{name}: box offsets {offsets} shape {shape} outside {list(ref.shape)}"
    return None


def assemble(key, boxes, ref):
    """The tensor put together from the boxes by hand, or raises when an element is not covered."""
    from safetensors import safe_open

    out = torch.zeros_like(ref)
    covered = torch.zeros(ref.shape, dtype=torch.int32)
    for path, _, shape, offsets in boxes:
        with safe_open(path, framework="pt") as f:
            part = f.get_tensor(key)
        region = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
        out[region] = part
        covered[region] += 1
    if ref.numel() and covered.min().item() == 0:
        raise ValueError(f"{(covered == 0).sum().item()} of {ref.numel()} elements in no box")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_dir")
    p.add_argument("reference")
    args = p.parse_args()
    if not os.path.isdir(args.ckpt_dir):
        print(f"FAIL: {args.ckpt_dir} is not a folder", file=sys.stderr)
        return 2

    from safetensors.torch import load_file
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reference = load_file(args.reference)
    boxes, other_files = scan(args.ckpt_dir)
    print(f"checkpoint {args.ckpt_dir}: {len(boxes)} keys in "
          f"{len({b[0] for v in boxes.values() for b in v})} safetensors files")
    if other_files:
        print(f"  other files (not read): {other_files}")
    extra = sorted(set(boxes) - set(reference))
    groups = {}
    for key in extra:
        groups.setdefault(group_of(key), []).append(key)
    for g in sorted(groups):
        print(f"  not compared ({g}, {len(groups[g])}): {groups[g]}")

    missing = [k for k in reference if k not in boxes]
    if missing:
        print(f"FAIL: the checkpoint lacks {len(missing)} reference keys: {missing}", file=sys.stderr)
        return 1
    for key, ref in reference.items():
        why = check_boxes(key, boxes[key], ref)
        if why:
            print(f"FAIL: {key}: {why}", file=sys.stderr)
            return 1

    # DCP's own reader, single process (no process group).
    state = {k: torch.zeros_like(v) for k, v in reference.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(args.ckpt_dir))
    for key, ref in reference.items():
        d = first_difference(state[key], ref)
        if d:
            print(f"FAIL: {key} loaded by torch.distributed.checkpoint differs from the reference: {d}",
                  file=sys.stderr)
            return 1

    # The same from the boxes by hand.
    for key, ref in reference.items():
        try:
            got = assemble(key, boxes[key], ref)
        except ValueError as e:
            print(f"FAIL: {key}: {e}", file=sys.stderr)
            return 1
        d = first_difference(got, ref)
        if d:
            print(f"FAIL: {key} assembled from its boxes differs from the reference: {d}", file=sys.stderr)
            return 1

    for key, ref in reference.items():
        shapes = [(b[3], b[2]) for b in boxes[key]]
        print(f"  {key} {list(ref.shape)} {ref.dtype}: {len(shapes)} boxes (offsets, shape) {shapes}")
    print(f"OK: {len(reference)} reference keys match bit for bit (torch.distributed.checkpoint.load and by hand)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
