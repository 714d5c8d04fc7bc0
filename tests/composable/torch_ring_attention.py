"""PyTorch's own ring attention on CPU with Gloo (2 processes), the reference of ring_attention_torch_test.

usage: torch_ring_attention.py OUT_DIR

torch.distributed.tensor.experimental.context_parallel does not run on CPU (torch 2.15): its
SDPA handlers cover the CUDA kernels only (_scaled_dot_product_flash/efficient/cudnn_attention),
while CPU SDPA dispatches to aten._scaled_dot_product_flash_attention_for_cpu, which DTensor has
no sharding strategy for ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does
not have a sharding strategy registered"). This script first shows that (the public API, on the
same inputs), then runs the ring that context_parallel would run, torch's own
_templated_ring_attention / _templated_ring_attention_backward (the head-tail load balancing, the
LSE merge, the dK/dV rotation), with the CPU flash kernels as the per-block op, on inputs sharded
by torch's own _HeadTailLoadBalancer (load-balanced) or plain chunks (contiguous).

Writes OUT_DIR/inputs.safetensors (full q, k, v, dout) and OUT_DIR/rank{r}.safetensors: for each
variant, torch's local inputs and its out, dq, dk, dv (keys "<variant>.<name>").
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import save_file

B, H, T, D = 2, 4, 16, 16
WORLD = 2
# (name, load balanced, causal). torch's ring refuses load balancing without the causal mask.
VARIANTS = [("balanced_causal", True, True), ("contiguous_causal", False, True), ("contiguous_full", False, False)]


def inputs():
    g = torch.Generator().manual_seed(1234)
    return {name: torch.randn(B, H, T, D, generator=g) for name in ("q", "k", "v", "dout")}


def probe_public_api(mesh, full):
    """The public context_parallel on CPU: returns the error it raises (or None if it ran)."""
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v = (full[n].clone() for n in ("q", "k", "v"))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as e:  # noqa: BLE001 - the error is the finding
        return f"{type(e).__name__}: {e}"
    return None


def run(rank, out_dir, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    mesh = init_device_mesh("cpu", (WORLD,))
    group = mesh.get_group()
    full = inputs()
    aten = torch.ops.aten

    error = probe_public_api(mesh, full)
    if rank == 0:
        print(f"torch.distributed.tensor.experimental.context_parallel on CPU/Gloo: "
              f"{'runs' if error is None else 'fails: ' + error}", flush=True)

    out_file = {}
    for name, balanced, causal in VARIANTS:
        balancer = _HeadTailLoadBalancer(T, WORLD, torch.device("cpu")) if balanced else None
        local = cp_attention._context_parallel_shard(
            mesh, [full[n] for n in ("q", "k", "v", "dout")], [2, 2, 2, 2], load_balancer=balancer)
        q, k, v, dout = (t.contiguous() for t in local)
        assert cp_attention._cp_options.enable_load_balance == balanced
        out, lse = cp_attention._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, is_causal=causal)
        dq, dk, dv = cp_attention._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout,
            grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=causal,
            dropout_p=0.0)[:3]
        # Sanity: torch's ring against SDPA on the whole sequence, sharded the same way.
        ref = {n: full[n].clone().requires_grad_() for n in ("q", "k", "v")}
        ref_out = F.scaled_dot_product_attention(ref["q"], ref["k"], ref["v"], is_causal=causal)
        ref_out.backward(full["dout"])
        want = cp_attention._context_parallel_shard(
            mesh, [ref_out.detach(), ref["q"].grad, ref["k"].grad, ref["v"].grad], [2, 2, 2, 2],
            load_balancer=balancer)
        for what, got, exp in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
            err = (got - exp).abs().max().item()
            assert torch.allclose(got, exp, rtol=1e-5, atol=1e-5), (name, what, err)
        for key, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out), ("dq", dq), ("dk", dk),
                       ("dv", dv)):
            out_file[f"{name}.{key}"] = t.contiguous()
        if rank == 0:
            print(f"torch ring ({name}) equals SDPA on the whole sequence (rtol/atol 1e-5)", flush=True)
    save_file(out_file, os.path.join(out_dir, f"rank{rank}.safetensors"))
    if rank == 0:
        save_file({n: t.contiguous() for n, t in full.items()}, os.path.join(out_dir, "inputs.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    port = 20000 + os.getpid() % 20000
    mp.spawn(run, args=(out_dir, port), nprocs=WORLD)
