"""Exact comparison of named tensors, shared by the checkpoint checking scripts."""

import torch


def first_difference(a, b):
    """None when a and b have the same dtype, shape and bits; else a short description."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    if a.numel() == 0:
        return None
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(ab, bb):
        return None
    elem = a.element_size()
    bad = (ab != bb).nonzero()[0].item() // elem
    flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
    msg = f"element {bad} (flat index) is {flat_a[bad].item()!r}, expected {flat_b[bad].item()!r}"
    if a.is_floating_point():
        diff = (flat_a.double() - flat_b.double()).abs()
        msg += f"; max abs difference {diff.nan_to_num(float('inf')).max().item():.3g}"
    return msg


def compare_dicts(got, expected, keys=None):
    """[(key, description)] of the differences over `keys` (default: expected's keys, in order)."""
    out = []
    for key in keys if keys is not None else list(expected):
        if key not in got:
            out.append((key, "missing"))
            continue
        d = first_difference(got[key], expected[key])
        if d is not None:
            out.append((key, d))
    return out
