#!/usr/bin/env python3
"""Tensor-parallel checkpoints with PyTorch's FSDP2 + DTensor tensor parallelism, for the C++
interop test (tests/checkpoint/tp_interop_test.sh):

    fsdp2_tp_checkpoint.py write OUT_DIR --dp D --tp T [--seed S]
    fsdp2_tp_checkpoint.py read CKPT_DIR REFERENCE.safetensors --dp D --tp T

The model is the example GPT of examples/gpt_model.h with the same FQNs (vocabulary 24, context 12,
d_model 24, 12 heads, 2 blocks). Runs D*T processes (Gloo on the CPU, a FileStore), lays them out as
init_device_mesh("cpu", (D, T), mesh_dim_names=("dp", "tp")), applies parallelize_module over "tp"
(tok_emb RowwiseParallel, attn.qkv and mlp.fc ColwiseParallel, attn.proj and mlp.proj
RowwiseParallel: the parameters become DTensors sharded over tp) and fully_shard over "dp" to each
block and the root.

write: the parameters get deterministic values (torch.manual_seed(S), randn in named_parameters
order, before parallelizing); rank 0 writes them to OUT_DIR/reference.safetensors; the model's
state dict is saved with dcp.save(..., HuggingFaceStorageWriter(OUT_DIR/ckpt, save_distributed=True));
the full state dict (get_model_state_dict, full_state_dict) must equal the reference.

read: dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(CKPT_DIR)) into a model
of other values, then its full state dict must equal REFERENCE.safetensors bit for bit.

Exit 0 on success, 1 with the first differing key otherwise.
"""

import argparse
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_util import compare_dicts  # noqa: E402

warnings.filterwarnings("ignore")

VOCAB, CONTEXT, D_MODEL, N_LAYERS = 24, 12, 24, 2


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attn(d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList([Block(D_MODEL) for _ in range(N_LAYERS)])
        self.ln_f = nn.LayerNorm(D_MODEL)


def build(seed):
    model = GPT()
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape))
    return model


def parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate())}
    for i in range(N_LAYERS):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def full_values(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().contiguous() for k, v in full.items()}


def worker(rank, world, args, store_path):
    from safetensors.torch import load_file, save_file
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    failed = False
    try:
        mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
        if args.mode == "write":
            model = build(args.seed)
            reference = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
            parallelize(model, mesh)
            dcp.save(model.state_dict(),
                     storage_writer=HuggingFaceStorageWriter(os.path.join(args.out, "ckpt"), save_distributed=True))
            full = full_values(model)
            if rank == 0:
                save_file(reference, os.path.join(args.out, "reference.safetensors"))
        else:
            model = build(args.seed + 1000)
            parallelize(model, mesh)
            state = model.state_dict()
            dcp.load(state, storage_reader=HuggingFaceStorageReader(args.ckpt))
            model.load_state_dict(state)
            full = full_values(model)
            reference = load_file(args.reference) if rank == 0 else None
        if rank == 0:
            diffs = compare_dicts(full, reference)
            if diffs or len(full) != len(reference):
                print(f"FAILED ({args.mode} at dp={args.dp}, tp={args.tp}): {diffs[:3]}, "
                      f"{len(full)} tensors vs {len(reference)} in the reference", flush=True)
                failed = True
            else:
                print(f"{args.mode} at (dp={args.dp}, tp={args.tp}): {len(full)} tensors equal the reference",
                      flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write")
    w.add_argument("out")
    r = sub.add_parser("read")
    r.add_argument("ckpt")
    r.add_argument("reference")
    for q in (w, r):
        q.add_argument("--dp", type=int, default=1)
        q.add_argument("--tp", type=int, default=2)
        q.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.mode == "write":
        args.out = os.path.abspath(args.out)
        os.makedirs(args.out, exist_ok=True)
    world = args.dp * args.tp
    with tempfile.TemporaryDirectory(prefix="fsdp2tp") as tmp:
        store = os.path.join(tmp, "store")
        if world == 1:
            worker(0, 1, args, store)
        else:
            import torch.multiprocessing as mp
            mp.spawn(worker, args=(world, args, store), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
