"""torch.optim.Muon on the unsharded matrices of tools/bench/muon_bench.cc (one process, one thread):
the PyTorch side of tools/muon_benchmark.sh.

usage: muon_bench_torch.py [--d-model 256] [--layers 2] [--steps 5] [--warmup 1] [--out PATH.json]

Per layer q, k, v, o [d, d], up [4d, d], down [d, 4d] (bias-free Linear weights), fixed random
gradients; prints the median step time in ms over --steps steps after --warmup.
"""

import argparse
import json
import statistics
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = args.d_model
    torch.manual_seed(0)
    params = []
    for _ in range(args.layers):
        for out_features, in_features in ((d, d), (d, d), (d, d), (d, d), (4 * d, d), (d, 4 * d)):
            p = torch.nn.Parameter(torch.randn(out_features, in_features) / in_features**0.5)
            p.grad = torch.randn_like(p)
            params.append(p)
    muon = torch.optim.Muon(params, lr=0.02)
    times = []
    for s in range(args.warmup + args.steps):
        start = time.perf_counter()
        muon.step()
        ms = (time.perf_counter() - start) * 1e3
        if s >= args.warmup:
            times.append(ms)
    step_ms = statistics.median(times)
    print(f"torch.optim.Muon unsharded: {len(params)} matrices, step {step_ms:.2f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"step_ms": step_ms, "matrices": len(params), "d_model": d, "layers": args.layers}, f)


if __name__ == "__main__":
    main()
