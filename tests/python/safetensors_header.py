"""Reads the JSON header of a safetensors file without loading its data (the format: 8 bytes little
endian header length N, N bytes of JSON {"__metadata__": {str: str}, key: {"dtype", "shape",
"data_offsets"}}, then the data)."""

import json
import os
import struct


def read_header(path):
    """(tensor entries {key: {"dtype", "shape", "data_offsets"}}, metadata {str: str})."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: header length {n} beyond the end of the file")
        header = json.loads(f.read(n))
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata


def sharding_info(metadata):
    """The DCP_SHARDING_INFO of a file's metadata as {key: saved_offsets}, or None."""
    text = metadata.get("DCP_SHARDING_INFO")
    if not text:
        return None
    return {k: list(v["saved_offsets"]) for k, v in json.loads(text).items()}


def describe_dir(path):
    """One line per file of a checkpoint folder: its name and, per entry, dtype, shape and box."""
    lines = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not name.endswith(".safetensors"):
            lines.append(f"{name}: not safetensors ({os.path.getsize(full)} bytes)")
            continue
        entries, metadata = read_header(full)
        info = sharding_info(metadata) or {}
        lines.append(f"{name}: {len(entries)} entries, metadata keys {sorted(metadata)}")
        for key in sorted(entries):
            e = entries[key]
            lines.append(f"  {key}: {e['dtype']} shape {e['shape']} saved_offsets {info.get(key)}")
    return lines
