#!/usr/bin/env python3
"""PyTorch's side of the benchmark: the models of tools/bench/bench_models.h in Python, with the
weights and data of the same init file (written by `fsdp_bench --write-init`), trained with plain
local training, FSDP2 (`torch.distributed.fsdp.fully_shard`) and FSDP1
(`FullyShardedDataParallel(use_orig_params=True)`) on the CPU with the Gloo backend.

    python3 tools/bench/torch_bench.py --init FILE --out JSON --world 1 [--variants local,fsdp2,fsdp1]
    python3 tools/bench/torch_bench.py --init FILE --out JSON --world 2 --variants fsdp2,fsdp1

The variants of a model train step by step in turn (as fsdp_bench does), each step zero_grad +
forward + backward + AdamW step; per step it records the time (forward+backward and optimizer
step apart) and the loss. World size 2 runs two processes (torch.multiprocessing) over Gloo.
`--check` only checks that FSDP2 and FSDP1 run on the CPU with this torch and says what fails.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------------------------
# Models (same architecture and parameter names as the C++ side)

class TinyBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TinyNet(nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock(dim) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        heads = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Mlp(nn.Module):
    def __init__(self, d, ratio):
        super().__init__()
        self.fc = nn.Linear(d, ratio * d)
        self.proj = nn.Linear(ratio * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, heads, ratio):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = Mlp(d, ratio)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, context, d, heads, layers, ratio):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, ratio) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1])
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        # The output layer is tied to the token embedding, as in examples/gpt_model.h.
        return self.ln_f(x).matmul(self.tok_emb.weight.t())


def build(model, tensors):
    """The model named `model` with the init file's weights, its block class, and its loss."""
    if model == "tiny":
        dim, depth, _ = tensors["tiny.config"].tolist()
        net = TinyNet(dim, depth)
        block_cls = TinyBlock
        x, y = tensors["tiny.x"], tensors["tiny.y"]

        def loss(m, rank, i):
            r, b = rank % x.shape[0], i % x.shape[1]
            return F.mse_loss(m(x[r][b]), y[r][b])
    elif model == "gpt":
        vocab, context, d, heads, layers, ratio, _ = tensors["gpt.config"].tolist()
        net = GPT(vocab, context, d, heads, layers, ratio)
        block_cls = Block
        tokens = tensors["gpt.tokens"]
        t = tokens.shape[3] - 1

        def loss(m, rank, i):
            w = tokens[rank % tokens.shape[0]][i % tokens.shape[1]]
            logits = m(w[:, :t])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
    else:
        raise ValueError(f"unknown model {model!r}")
    prefix = model + "."
    state = {k[len(prefix):]: v for k, v in tensors.items()
             if k.startswith(prefix) and k[len(prefix):] in dict(net.named_parameters())}
    missing = set(dict(net.named_parameters())) - set(state)
    if missing:
        raise RuntimeError(f"init file lacks {sorted(missing)[:5]}")
    net.load_state_dict(state, strict=True)
    return net, block_cls, loss


def wrap(net, block_cls, variant, world):
    if variant == "local":
        return net
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for m in net.modules():
            if isinstance(m, block_cls):
                fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net
    if variant == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({block_cls}), use_orig_params=True,
                    device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD)
    raise ValueError(f"unknown variant {variant!r}")


class Trainee:
    def __init__(self, model, variant, tensors, world, lr):
        net, block_cls, self.loss_fn = build(model, tensors)
        self.variant = variant
        self.module = wrap(net, block_cls, variant, world)
        self.optim = torch.optim.AdamW(self.module.parameters(), lr=lr, weight_decay=0.01)
        self.fb_s, self.opt_s, self.step_s, self.cpu_s, self.losses = [], [], [], [], []

    def step(self, rank, i):
        c0 = time.process_time()  # every thread of the process
        t0 = time.perf_counter()
        self.optim.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.module, rank, i)
        loss.backward()
        t1 = time.perf_counter()
        self.optim.step()
        t2 = time.perf_counter()
        self.fb_s.append(t1 - t0)
        self.opt_s.append(t2 - t1)
        self.step_s.append(t2 - t0)
        self.cpu_s.append(time.process_time() - c0)
        self.losses.append(loss.item())


def sharded_note(trainee):
    """What FSDP1 chose (it falls back to NO_SHARD at world size 1)."""
    if trainee.variant == "fsdp1":
        return str(trainee.module.sharding_strategy).split(".")[-1]
    if trainee.variant == "fsdp2":
        return "FULL_SHARD (reshard_after_forward=True)"
    return "unsharded"


def bench_models(rank, world, args, tensors):
    out = {}
    for model in args.models:
        warmup = args.gpt_warmup if model == "gpt" else args.warmup
        steps = args.gpt_steps if model == "gpt" else args.steps
        trainees, errors = [], {}
        for v in args.variants:
            try:
                trainees.append(Trainee(model, v, tensors, world, args.lr))
            except Exception as e:  # reported, the others still run
                errors[v] = f"{type(e).__name__}: {e}"
        if rank == 0:
            print(f"[torch_bench] W={world} {model}: {', '.join(t.variant for t in trainees)}",
                  file=sys.stderr, flush=True)
        for i in range(warmup + steps):
            order = trainees if i % 2 == 0 else list(reversed(trainees))
            for t in order:
                t.step(rank, i)
        out[model] = {
            "warmup": warmup, "steps": steps,
            "variants": {t.variant: {"step_s": t.step_s, "fb_s": t.fb_s, "opt_s": t.opt_s, "cpu_s": t.cpu_s,
                                     "losses": t.losses, "sharding": sharded_note(t)}
                         for t in trainees},
            "errors": errors,
        }
        del trainees
    return out


def load_init(path):
    """The init file: a dict of named tensors written by torch::pickle_save in C++ (its typed dict
    carries a type tag, which weights_only loading allows once named)."""
    import torch.jit._pickle
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        tensors = torch.load(path, weights_only=True)
    return dict(tensors)


def init_pg(rank, world, store_path):
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def worker(rank, world, args, result_path, store_path):
    torch.set_num_threads(args.threads)
    init_pg(rank, world, store_path)
    try:
        tensors = load_init(args.init)
        mine = {"rank": rank, "timing": bench_models(rank, world, args, tensors)}
        with open(f"{result_path}.rank{rank}", "w") as f:
            json.dump(mine, f)
        dist.barrier()
        if rank == 0:
            ranks = []
            for r in range(world):
                with open(f"{result_path}.rank{r}") as f:
                    ranks.append(json.load(f))
                os.remove(f"{result_path}.rank{r}")
            with open(result_path, "w") as f:
                json.dump({"program": "torch_bench", "torch": torch.__version__, "world_size": world,
                           "threads": torch.get_num_threads(), "ranks": ranks}, f)
    finally:
        dist.destroy_process_group()


def check(tmp):
    """Whether FSDP2 and FSDP1 run on the CPU with Gloo at world size 1; what fails if not."""
    torch.set_num_threads(1)
    init_pg(0, 1, os.path.join(tmp, "check_store"))
    results = {}
    tensors = {"tiny.config": torch.tensor([8, 4, 4]), "tiny.x": torch.randn(1, 1, 4, 8),
               "tiny.y": torch.randn(1, 1, 4, 8)}
    for k, v in TinyNet(8, 4).state_dict().items():
        tensors["tiny." + k] = v
    attempts = [
        ("fsdp2 (mesh device type 'cpu')", lambda n, b: wrap(n, b, "fsdp2", 1)),
        ("fsdp1 (device_id=torch.device('cpu'))", lambda n, b: wrap(n, b, "fsdp1", 1)),
    ]

    def fsdp1_none(n, b):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FSDP(n, auto_wrap_policy=ModuleWrapPolicy({b}), use_orig_params=True, device_id=None)

    attempts.append(("fsdp1 (device_id=None)", fsdp1_none))
    for name, fn in attempts:
        try:
            net, block_cls, loss_fn = build("tiny", tensors)
            m = fn(net, block_cls)
            loss_fn(m, 0, 0).backward()
            results[name] = "ok"
        except Exception as e:
            results[name] = f"FAILS: {type(e).__name__}: {str(e).splitlines()[0]}"
    dist.destroy_process_group()
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init")
    p.add_argument("--out")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--models", type=lambda s: s.split(","), default=["tiny", "gpt"])
    p.add_argument("--variants", type=lambda s: s.split(","), default=["local", "fsdp2", "fsdp1"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--gpt-warmup", type=int, default=3)
    p.add_argument("--gpt-steps", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tb") as tmp:
        if args.check:
            results = check(tmp)
            for k, v in results.items():
                print(f"  {k}: {v}")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"torch": torch.__version__, "checks": results}, f)
            return 0
        if not args.init or not args.out:
            p.error("--init and --out are needed")
        store = os.path.join(tmp, "store")
        if args.world == 1:
            worker(0, 1, args, args.out, store)
        else:
            import torch.multiprocessing as mp
            mp.spawn(worker, args=(args.world, args, args.out, store), nprocs=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
