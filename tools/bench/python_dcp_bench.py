#!/usr/bin/env python3
"""Save and load throughput of PyTorch's torch.distributed.checkpoint (DCP) on this machine, as the
yardstick for the library's checkpoint writer and reader:

    python3 tools/bench/python_dcp_bench.py --size-mb 300 --dir DIR [--world-size 1|2]
                                            [--tensors 24] [--repeats 1] [--no-sync] [--keep]

The state dict: --tensors float32 tensors of equal size [rows, 1024] totalling --size-mb MiB
(deterministic values). At world size W (processes over Gloo on the CPU) each tensor is a DTensor
sharded Shard(0) over the W ranks, and each rank allocates only its own rows, so a rank holds about
size/W for the saved state plus as much for the load targets.

For each storage, every repeat saves into a fresh folder and loads into zero DTensors of the same
shapes and placements, then checks the loaded values equal the saved ones:
  * fs: DCP's default FileSystemWriter / FileSystemReader (one .distcp file per rank + .metadata);
  * hf: HuggingFaceStorageWriter(save_distributed=True) / HuggingFaceStorageReader (one
        shard-<r+1:05d>-model-00001-of-00001.safetensors per rank, boxes in DCP_SHARDING_INFO).
Both writers fsync every file they write (FileSystemWriter's sync_files=True, which
HuggingFaceStorageWriter inherits); --no-sync turns that off for both. The load runs right after
the save, so it reads from the page cache (nothing is dropped).

Timing: a barrier, then the save (or load) call, then a barrier; the time is the slowest rank's.
Output: one machine-readable line per measurement on stdout (from rank 0), e.g.
    python_dcp save fs W=1 bytes=314572800 seconds=0.812 GB/s=0.387 sync=1 repeat=0
GB/s is 1e9 bytes per second over the state dict's total bytes (all ranks together).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

COLS = 1024


def build_state(rank, world, args, mesh):
    """{name: DTensor} of this rank's shards (Shard(0), uneven when rows do not divide by W)."""
    from torch.distributed.tensor import DTensor, Shard

    total_floats = args.size_mb * 1024 * 1024 // 4
    rows = max(1, total_floats // (args.tensors * COLS))
    state = {}
    for t in range(args.tensors):
        chunk = -(-rows // world)  # rows of every rank but the last, as torch.chunk splits
        start = min(rank * chunk, rows)
        stop = min(start + chunk, rows)
        local = torch.arange(start * COLS, stop * COLS, dtype=torch.float32).reshape(stop - start, COLS)
        local.mul_(1e-3).add_(t)
        state[f"layers.{t}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size([rows, COLS]),
            stride=(COLS, 1))
    return state, rows * COLS * 4 * args.tensors


def zeros_like_state(state):
    from torch.distributed.tensor import DTensor

    return {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                  run_check=False, shape=v.shape, stride=v.stride())
            for k, v in state.items()}


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def writer_reader(kind, path, sync):
    from torch.distributed.checkpoint import (FileSystemReader, FileSystemWriter, HuggingFaceStorageReader,
                                              HuggingFaceStorageWriter)

    if kind == "fs":
        return FileSystemWriter(path, sync_files=sync), lambda: FileSystemReader(path)
    w = HuggingFaceStorageWriter(path, save_distributed=True)
    w.sync_files = sync  # inherited from FileSystemWriter (True by default)
    return w, lambda: HuggingFaceStorageReader(path)


def worker(rank, world, args, store_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state, nbytes = build_state(rank, world, args, mesh)
        for repeat in range(args.repeats):
            for kind in ("fs", "hf"):
                path = os.path.join(args.dir, f"{kind}_w{world}_r{repeat}")
                if rank == 0 and os.path.exists(path):
                    shutil.rmtree(path)
                dist.barrier()
                writer, make_reader = writer_reader(kind, path, not args.no_sync)
                t_save = timed(lambda: dcp.save(state, storage_writer=writer))
                target = zeros_like_state(state)
                t_load = timed(lambda: dcp.load(target, storage_reader=make_reader()))
                ok = all(torch.equal(target[k].to_local(), state[k].to_local()) for k in state)
                flag = torch.tensor([0 if ok else 1])
                dist.all_reduce(flag)
                del target
                if rank == 0:
                    files = sorted(os.listdir(path))
                    disk = sum(os.path.getsize(os.path.join(path, f)) for f in files)
                    for op, dt in (("save", t_save), ("load", t_load)):
                        print(f"python_dcp {op} {kind} W={world} bytes={nbytes} seconds={dt:.4f} "
                              f"GB/s={nbytes / dt / 1e9:.3f} sync={0 if args.no_sync else 1} repeat={repeat} "
                              f"files={len(files)} disk_bytes={disk}", flush=True)
                    if flag.item():
                        print(f"python_dcp ERROR {kind} W={world}: loaded values differ from the saved ones",
                              flush=True)
                if flag.item():
                    raise SystemExit(1)
                dist.barrier()
                if rank == 0 and not args.keep:
                    shutil.rmtree(path)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=300)
    p.add_argument("--dir", required=True)
    p.add_argument("--world-size", type=int, default=1, choices=[1, 2])
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-sync", action="store_true", help="no fsync of the written files")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    args = p.parse_args()
    args.dir = os.path.abspath(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    print(f"# torch {torch.__version__}, {args.tensors} float32 tensors, {args.size_mb} MiB, "
          f"W={args.world_size}, dir {args.dir}, load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dcpb") as tmp:
        store = os.path.join(tmp, "store")
        if args.world_size == 1:
            worker(0, 1, args, store)
        else:
            import torch.multiprocessing as mp
            mp.spawn(worker, args=(args.world_size, args, store), nprocs=args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
