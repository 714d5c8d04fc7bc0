"""How an expert-parallel rank computes its local experts: a loop over the experts (what
models/moe.cc does: each expert its own module and fully_shard unit, called on its rows) against
one grouped matmul (torch._grouped_mm over the rows of every expert, the weights stacked), the
latter with and without the stacking copy the per-expert modules would need each forward. SwiGLU
experts (gate, up, down), float32, one intra-op thread, the same rows and weights for all three;
prints the median times and the ratios against the loop.

  tools/bench/expert_compute_bench.py [--experts 4] [--hidden 256] [--inter 512] [--rows 2000] [--iters 20]

Rows per expert are uneven (one expert gets none), as routing gives them.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    E, H, I = a.experts, a.hidden, a.inter
    weights = torch.rand(E)
    weights[1] = 0.0  # an expert without rows
    counts = (weights / weights.sum() * a.rows).long()
    counts[-1] += a.rows - counts.sum()
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), H)
    gate = [torch.randn(I, H) / H ** 0.5 for _ in range(E)]
    up = [torch.randn(I, H) / H ** 0.5 for _ in range(E)]
    down = [torch.randn(H, I) / I ** 0.5 for _ in range(E)]
    gate_s = torch.stack([g.t() for g in gate]).contiguous()
    up_s = torch.stack([u.t() for u in up]).contiguous()
    down_s = torch.stack([d.t() for d in down]).contiguous()

    def loop():
        outs, at = [], 0
        for e in range(E):
            rows = x[at:at + int(counts[e])]
            outs.append((F.silu(rows @ gate[e].t()) * (rows @ up[e].t())) @ down[e].t())
            at += int(counts[e])
        return torch.cat(outs)

    def grouped(gs, us, ds):
        h = F.silu(torch._grouped_mm(x, gs, offs=offs)) * torch._grouped_mm(x, us, offs=offs)
        return torch._grouped_mm(h, ds, offs=offs)

    def grouped_stacked():
        return grouped(gate_s, up_s, down_s)

    def grouped_with_stacking():
        return grouped(torch.stack([g.t() for g in gate]).contiguous(), torch.stack([u.t() for u in up]).contiguous(),
                       torch.stack([d.t() for d in down]).contiguous())

    ref = loop()
    for f in (grouped_stacked, grouped_with_stacking):
        err = (f() - ref).abs().max().item()
        assert err < 1e-3, f"{f.__name__} differs from the loop by {err}"
    times = {}
    for f in (loop, grouped_stacked, grouped_with_stacking):
        f()
        samples = []
        for _ in range(a.iters):
            t = time.perf_counter()
            f()
            samples.append(time.perf_counter() - t)
        times[f.__name__] = statistics.median(samples) * 1e3
    print(f"{E} experts, hidden {H}, intermediate {I}, {int(counts.sum())} rows {counts.tolist()}, float32, 1 thread "
          f"(torch {torch.__version__})")
    for name, ms in times.items():
        print(f"  {name:22s} {ms:8.2f} ms   x{ms / times['loop']:.2f} of the loop")


if __name__ == "__main__":
    main()
