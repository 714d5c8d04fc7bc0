#!/usr/bin/env python3
"""Writes the .pt fixtures of full_state_dict_files_test.cc with Python's torch.save (run from this
folder; the files are checked in):

  python_dict.pt          torch.save(dict) of closed-form tensors (see expected_state below)
  python_state_dict.pt    torch.save(module.state_dict()), an OrderedDict, of nn.Linear(3, 2) with
                          weight = arange(6).view(2, 3) / 2 and bias = [-1, 1]; LibTorch's
                          unpickler cannot build OrderedDicts, so the test expects a clear refusal
"""
import collections

import torch


def expected_state():
    return {
        "weight": torch.arange(12, dtype=torch.float32).view(3, 4) / 4,
        "half": torch.arange(5, dtype=torch.float16) - 2,
        "bf16": torch.arange(4, dtype=torch.bfloat16) * 3,
        "steps": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "column": (torch.arange(6, dtype=torch.float64).view(2, 3)).t(),  # not contiguous
    }


torch.save(expected_state(), "python_dict.pt")
linear = torch.nn.Linear(3, 2)
with torch.no_grad():
    linear.weight.copy_(torch.arange(6, dtype=torch.float32).view(2, 3) / 2)
    linear.bias.copy_(torch.tensor([-1.0, 1.0]))
assert isinstance(linear.state_dict(), collections.OrderedDict)
torch.save(linear.state_dict(), "python_state_dict.pt")
