#!/usr/bin/env python3
"""Builds the altered copies that the shell tests feed to the checking scripts, to show that they
fail when they must (and pass where only unrelated entries were added):

    make_test_variants.py ckpt-extras SRC_CKPT DST_CKPT
        copy of a Hugging Face-layout checkpoint plus what the C++ checkpoints add beside the model:
        a file extra-00001.safetensors with `state.<fqn>.exp_avg`, `param_groups.<fqn>.lr` and
        `extra.step` entries, and a non-safetensors manifest fsdp_checkpoint.json
    make_test_variants.py ckpt-drop-box SRC_CKPT DST_CKPT KEY
        copy whose last file (in name order) lacks KEY's box, so part of KEY is in no file
    make_test_variants.py ref-perturb SRC_REF DST_REF KEY
        copy of a reference with one element of KEY moved to the next float
    make_test_variants.py ref-add-key SRC_REF DST_REF KEY
        copy of a reference with one more tensor KEY
    make_test_variants.py reference OUT.safetensors [--seed S]
        the interop model's initial values (no training)
    make_test_variants.py exports REF DST_DIR
        REF in every full-export format check_full_export.py reads: DST_DIR/single/model.safetensors,
        DST_DIR/indexed/ (model-0000k-of-00002.safetensors + model.safetensors.index.json),
        DST_DIR/pickle.pt (LibTorch's pickle_save of the dict, through torch._C._pickle_save),
        DST_DIR/torch_save.pt (torch.save), and broken ones: DST_DIR/bad_index/ (index names a file
        that lacks a key), DST_DIR/bad_dtype.pt (norm.bias in float64)
"""

import json
import os
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)


def read_with_metadata(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})


def main(argv):
    cmd = argv[0]
    if cmd == "ckpt-extras":
        src, dst = argv[1:3]
        copy_ckpt(src, dst)
        save_file({
            "state.w1.weight.exp_avg": torch.ones(24, 13),
            "param_groups.w1.weight.lr": torch.tensor(0.01, dtype=torch.float64),
            "extra.step": torch.tensor(2),
        }, os.path.join(dst, "extra-00001.safetensors"))
        with open(os.path.join(dst, "fsdp_checkpoint.json"), "w") as f:
            json.dump({"format": "test manifest"}, f)
    elif cmd == "ckpt-drop-box":
        src, dst, key = argv[1:4]
        copy_ckpt(src, dst)
        last = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))[-1]
        path = os.path.join(dst, last)
        tensors, metadata = read_with_metadata(path)
        del tensors[key]
        info = json.loads(metadata["DCP_SHARDING_INFO"])
        del info[key]
        metadata["DCP_SHARDING_INFO"] = json.dumps(info)
        save_file(tensors, path, metadata=metadata)
    elif cmd == "ref-perturb":
        src, dst, key = argv[1:4]
        ref = load_file(src)
        t = ref[key].clone().reshape(-1)
        t[t.numel() // 2] = torch.nextafter(t[t.numel() // 2], torch.tensor(float("inf")))
        ref[key] = t.reshape(ref[key].shape)
        save_file(ref, dst)
    elif cmd == "ref-add-key":
        src, dst, key = argv[1:4]
        ref = load_file(src)
        ref[key] = torch.zeros(3)
        save_file(ref, dst)
    elif cmd == "reference":
        import interop_model
        seed = int(argv[3]) if len(argv) > 3 and argv[2] == "--seed" else 0
        save_file({k: v.detach().contiguous() for k, v in interop_model.build_model(seed).state_dict().items()}, argv[1])
    elif cmd == "exports":
        src, dst = argv[1:3]
        ref = load_file(src)
        keys = list(ref)
        os.makedirs(os.path.join(dst, "single"))
        save_file(ref, os.path.join(dst, "single", "model.safetensors"))
        halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
        for folder, broken in (("indexed", False), ("bad_index", True)):
            os.makedirs(os.path.join(dst, folder))
            weight_map = {}
            for i, part in enumerate(halves, start=1):
                name = f"model-{i:05d}-of-00002.safetensors"
                stored = part[1:] if broken and i == 2 else part
                save_file({k: ref[k] for k in stored}, os.path.join(dst, folder, name))
                weight_map.update({k: name for k in part})
            size = sum(ref[k].numel() * ref[k].element_size() for k in keys)
            if broken:
                size -= ref[halves[1][0]].numel() * ref[halves[1][0]].element_size()
            with open(os.path.join(dst, folder, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(dst, "pickle.pt"), "wb") as f:
            f.write(torch._C._pickle_save(ref))
        torch.save(ref, os.path.join(dst, "torch_save.pt"))
        bad = dict(ref)
        bad["norm.bias"] = bad["norm.bias"].double()
        with open(os.path.join(dst, "bad_dtype.pt"), "wb") as f:
            f.write(torch._C._pickle_save(bad))
    else:
        print(f"unknown command {cmd}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
