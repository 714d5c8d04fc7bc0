#!/usr/bin/env python3
"""Writes a distributed checkpoint of the interop model (interop_model.py) with PyTorch's FSDP2 and
torch.distributed.checkpoint's Hugging Face storage, and the full values it must hold:

    fsdp2_write_checkpoint.py OUT_DIR [--world-size 2] [--steps 2] [--seed 0]

Runs W processes (torch.multiprocessing, Gloo on the CPU, a FileStore in a temporary folder). Each
builds the model with its deterministic initial values, applies `fully_shard` to emb, w1, w2, norm
and then the root (mesh of W CPU ranks: every parameter becomes a DTensor sharded Shard(0), uneven
where the first dimension does not divide by W), trains --steps AdamW steps (lr 1e-2) on the
deterministic batches of interop_model.batch(step, rank), then

  * saves `model.state_dict()` with `torch.distributed.checkpoint.save(...,
    storage_writer=HuggingFaceStorageWriter(OUT_DIR/ckpt, save_distributed=True))`: each rank r writes
    OUT_DIR/ckpt/shard-<r+1:05d>-model-00001-of-00001.safetensors with its local shard of every
    parameter, the file's __metadata__ holding DCP_SHARDING_INFO = JSON {fqn: {"saved_offsets":
    [...]}} (where the shard starts in the global tensor); no index or .metadata file;
  * rank 0 writes the full values (get_model_state_dict with full_state_dict, cpu_offload) to
    OUT_DIR/reference.safetensors with safetensors.torch.save_file.

Prints the files written and their entries. Exit status 0 on success.
"""

import argparse
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interop_model  # noqa: E402
from safetensors_header import describe_dir  # noqa: E402

warnings.filterwarnings("ignore")


def worker(rank, world, args, store_path):
    from safetensors.torch import save_file
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = interop_model.build_model(args.seed)
        for name in interop_model.SHARDED_SUBMODULES:
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        for step in range(args.steps):
            idx, target = interop_model.batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(idx), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)

        ckpt = os.path.join(args.out_dir, "ckpt")
        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(ckpt, save_distributed=True))

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            ref = {k: v.detach().contiguous() for k, v in full.items()}
            init = interop_model.build_model(args.seed).state_dict()
            if args.steps > 0 and all(torch.equal(ref[k], init[k]) for k in init):
                raise RuntimeError("training left every parameter at its initial value")
            save_file(ref, os.path.join(args.out_dir, "reference.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out_dir = os.path.abspath(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fsdp2ck") as tmp:
        store = os.path.join(tmp, "store")
        if args.world_size == 1:
            worker(0, 1, args, store)
        else:
            import torch.multiprocessing as mp
            mp.spawn(worker, args=(args.world_size, args, store), nprocs=args.world_size)
    print(f"wrote {args.out_dir}/reference.safetensors and {args.out_dir}/ckpt:")
    for line in describe_dir(os.path.join(args.out_dir, "ckpt")):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
