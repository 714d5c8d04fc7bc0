"""PyTorch's ring attention on CPU/Gloo, measured as tools/bench/ring_attention_benchmark.cc measures
ours: one attention layer forward + backward at cp = 1 (F.scaled_dot_product_attention on the whole
sequence, autograd) and cp = W (torch's own ring: _templated_ring_attention and its backward with the
CPU flash kernels, head-tail layout by _HeadTailLoadBalancer; the public context_parallel does not
run on CPU, see tests/composable/torch_ring_attention.py). Peaks through the project's counting
allocator (//tools/bench:libcounting_allocator_capi.so, ctypes) when its path is given.

usage: torch_ring_attention_bench.py W [T=4096] [H=8] [D=64] [ITERS=3] [ALLOCATOR_SO]
"""

import ctypes
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def allocator(path):
    if not path:
        return None
    lib = ctypes.CDLL(path)
    for name in ("fsdp_counting_current_since_mark", "fsdp_counting_peak_since_mark"):
        getattr(lib, name).restype = ctypes.c_int64
    lib.fsdp_counting_install()
    return lib


def slowest(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(cp, T, H, D, iters, lib):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.device_mesh import init_device_mesh

    g = torch.Generator().manual_seed(17)
    full = [torch.randn(1, H, T, D, generator=g) for _ in range(4)]
    aten = torch.ops.aten
    if cp > 1:
        mesh = init_device_mesh("cpu", (cp,))
        local = cpa._context_parallel_shard(mesh, full, [2] * 4, load_balancer=_HeadTailLoadBalancer(T, cp, torch.device("cpu")))
        q0, k0, v0, dout = (t.contiguous() for t in local)
        group = mesh.get_group()
    else:
        q0, k0, v0, dout = full
    fwd, bwd, peak, held = [], [], 0, 0
    for i in range(1 + iters):
        q, k, v = q0.clone(), k0.clone(), v0.clone()
        dist.barrier()
        if lib:
            lib.fsdp_counting_mark()
            lib.fsdp_counting_reset_peak()
        t0 = time.perf_counter()
        if cp > 1:
            out, lse = cpa._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, is_causal=True)
        else:
            q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t1 = time.perf_counter()
        h = lib.fsdp_counting_current_since_mark() if lib else 0
        if cp > 1:
            grads = cpa._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout,
                grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True,
                dropout_p=0.0)
        else:
            out.backward(dout)
        t2 = time.perf_counter()
        p = lib.fsdp_counting_peak_since_mark() if lib else 0
        if i == 0:
            continue
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
        peak, held = max(peak, p), max(held, h)
    med = lambda v: sorted(v)[len(v) // 2]
    return slowest(med(fwd)), slowest(med(bwd)), slowest(peak), slowest(held)


def run(rank, world, T, H, D, iters, so, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    lib = allocator(so)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    one = measure(1, T, H, D, iters, lib)
    ring = measure(world, T, H, D, iters, lib)
    if rank == 0:
        mib = lambda b: b / (1 << 20)
        print(f"torch ring attention (torch {torch.__version__}, Gloo), B=1 H={H} D={D} T={T} float32, "
              f"head-tail layout, median of {iters}, slowest rank")
        print(f"{'cp':<6} {'fwd ms':>10} {'bwd ms':>10} {'peak MiB/rank':>14} {'held MiB/rank':>14}")
        for cp, m in ((1, one), (world, ring)):
            print(f"{cp:<6} {m[0]:>10.1f} {m[1]:>10.1f} {mib(m[2]):>14.2f} {mib(m[3]):>14.2f}")
        print(f"ratios cp={world} / cp=1: fwd {ring[0] / one[0]:.3f}, bwd {ring[1] / one[1]:.3f}, "
              f"fwd+bwd {(ring[0] + ring[1]) / (one[0] + one[1]):.3f}"
              + (f", peak {ring[2] / one[2]:.3f}, held {ring[3] / one[3]:.3f}" if so else ""), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    world = int(a[0])
    T = int(a[1]) if len(a) > 1 else 4096
    H = int(a[2]) if len(a) > 2 else 8
    D = int(a[3]) if len(a) > 3 else 64
    iters = int(a[4]) if len(a) > 4 else 3
    so = a[5] if len(a) > 5 else ""
    mp.spawn(run, args=(world, T, H, D, iters, so, 20000 + os.getpid() % 20000), nprocs=world)
