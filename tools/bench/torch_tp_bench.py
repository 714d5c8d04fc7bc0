#!/usr/bin/env python3
"""PyTorch's side of the tensor-parallel benchmark (tools/tp_benchmark.sh), and the report that
merges both sides.

    python3 tools/bench/torch_tp_bench.py run --init FILE --out JSON [--world 4]
        [--layouts 4x1,2x2,2x2+sp,1x4,1x4+sp] [--warmup N] [--steps N]
    python3 tools/bench/torch_tp_bench.py report --cpp CPP.json --py PY.json --out JSON
        [--load-before X --load-after Y]

`run`: the GPT of examples/gpt_model.h in Python (pre-LayerNorm, FUSED qkv projection, GELU tanh
MLP, learned position embedding, output layer tied to the token embedding) with the weights and
data of the init file that `tp_bench --write-init` writes, trained on CPU with Gloo in `--world`
processes (torch.multiprocessing) on each (dp, tp) layout: DeviceMesh("cpu", (dp, tp),
mesh_dim_names=("dp", "tp")), torch.distributed.tensor.parallel.parallelize_module over the tp
mesh with the plan of examples/gpt_tensor_parallel.h (tok_emb RowwiseParallel; attn.qkv and
mlp.fc ColwiseParallel; attn.proj and mlp.proj RowwiseParallel; with "+sp" SequenceParallel on
the LayerNorms, Shard(1) layouts between them and PrepareModuleOutput Replicate -> Shard(0) on
pos_emb, and loss_parallel()), then fully_shard (FSDP2) on every block and the root over the dp
mesh. Not applied when tp = 1 (plain FSDP2). The fused qkv weight [3D, D] is stored for a
contiguous Shard(0) split: its rows are permuted so that rank r's piece is [q_r; k_r; v_r] (its
heads of q, k and v), as the C++ ColwiseParallel().chunks(3) splits it; the forward splits this
rank's output in three. The tied output layer: ln_f's output made a DTensor (Replicate, or
Shard(1) redistributed to Replicate with sequence parallelism) times the tp-sharded token
embedding's DTensor weight: vocabulary-parallel logits, gathered (full_tensor) unless loss
parallel. Steps are timed as tp_bench times them: the layouts in turn, a barrier before each
step, zero_grad(set_to_none) + forward + loss + backward + AdamW step, the slowest rank's time.

`report`: one table of both sides (step ms, ratio, peak per rank, collectives vs closed forms) and
the merged JSON.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")


def parse_layouts(text, world):
    out = []
    for item in filter(None, text.split(",")):
        dp, rest = item.split("x", 1)
        tp, *opts = rest.split("+")
        sp = "sp" in opts
        lp = sp or "lp" in opts
        dp, tp = int(dp), int(tp)
        if dp * tp != world:
            raise ValueError(f"layout {item}: {dp * tp} ranks, the world has {world}")
        out.append({"name": item, "dp": dp, "tp": tp, "sp": sp, "lp": lp})
    return out


# ---------------------------------------------------------------------------------------------
# run

def build_model_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.head_dim = d // heads
            self.qkv = nn.Linear(d, 3 * d)   # fused; under TP this rank's [q_r; k_r; v_r]
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            y = self.qkv(x)                  # [B, T, 3 D / n] (all T positions, also with SP)
            b, t, w3 = y.shape
            w = w3 // 3
            h = w // self.head_dim
            q, k, v = y.split(w, dim=2)
            heads = lambda z: z.view(b, t, h, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            return self.proj(o.transpose(1, 2).contiguous().view(b, t, w))

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
            self.tp_mesh = None
            self.sp = self.lp = False

        def forward(self, tokens):
            x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            h = self.ln_f(x)
            if self.tp_mesh is None:
                return h.matmul(self.tok_emb.weight.t())   # tied output layer
            from torch.distributed.tensor import DTensor, Replicate, Shard
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1) if self.sp else Replicate()])
            if self.sp:
                h = h.redistribute(self.tp_mesh, [Replicate()])   # all-gather; backward reduce-scatter
            logits = h.matmul(self.tok_emb.weight.t())            # Shard(-1): this rank's vocabulary
            return logits if self.lp else logits.full_tensor()

    return GPT, Block


def load_init(path):
    import torch
    import torch.jit._pickle
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return dict(torch.load(path, weights_only=True))


def qkv_for_tp(t, tp):
    """Rows of a fused [3D, ...] q/k/v tensor permuted so that a contiguous split in tp pieces gives
    rank r [q_r; k_r; v_r]."""
    import torch
    if tp == 1:
        return t
    q, k, v = t.chunk(3, dim=0)
    return torch.cat([torch.cat([z.chunk(tp, dim=0)[r] for z in (q, k, v)]) for r in range(tp)])


class Run:
    def __init__(self, layout, tensors, rank, world, lr):
        import torch
        import torch.nn.functional as F
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        GPT, Block = build_model_classes()
        vocab, context, d, heads, layers, ratio, global_batch = tensors["gpt.config"].tolist()
        self.layout = layout
        dp, tp, sp, lp = layout["dp"], layout["tp"], layout["sp"], layout["lp"]
        self.mesh = DeviceMesh("cpu", torch.arange(world).view(dp, tp), mesh_dim_names=("dp", "tp"))
        net = GPT(vocab, context, d, heads, layers, ratio)
        state = {k[4:]: v for k, v in tensors.items() if k.startswith("gpt.") and k not in ("gpt.config", "gpt.tokens")}
        for k in list(state):
            if ".attn.qkv." in k:
                state[k] = qkv_for_tp(state[k], tp)
        net.load_state_dict(state, strict=True)
        if tp > 1:
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                           SequenceParallel, parallelize_module)
            seq = Shard(1) if sp else Replicate()
            plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)}
            if sp:
                plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
                plan["ln_f"] = SequenceParallel(use_local_output=True)
            for i in range(layers):
                p = f"blocks.{i}."
                plan[p + "attn.qkv"] = ColwiseParallel(input_layouts=seq)
                plan[p + "attn.proj"] = RowwiseParallel(output_layouts=seq)
                plan[p + "mlp.fc"] = ColwiseParallel(input_layouts=seq)
                plan[p + "mlp.proj"] = RowwiseParallel(output_layouts=seq)
                if sp:
                    plan[p + "ln1"] = SequenceParallel(use_local_output=True)
                    plan[p + "ln2"] = SequenceParallel(use_local_output=True)
            parallelize_module(net, self.mesh["tp"], plan)
            net.tp_mesh, net.sp, net.lp = self.mesh["tp"], sp, lp
        for m in net.modules():
            if isinstance(m, Block):
                fully_shard(m, mesh=self.mesh["dp"])
        fully_shard(net, mesh=self.mesh["dp"])
        self.model = net
        self.optim = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
        b = global_batch // dp
        q = self.mesh["dp"].get_local_rank()
        self.tokens = tensors["gpt.tokens"][:, q * b:(q + 1) * b]
        self.batch = b
        self.step_s, self.fwd_s, self.bwd_s, self.opt_s, self.cpu_s, self.losses = [], [], [], [], [], []
        self.F = F

    def step(self, i, timed):
        w = self.tokens[i % self.tokens.shape[0]]
        t = w.shape[1] - 1
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.optim.zero_grad(set_to_none=True)
        logits = self.model(w[:, :t])
        targets = w[:, 1:]
        if self.layout["lp"]:
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss = self.F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                t1 = time.perf_counter()
                loss.backward()
            loss = loss.to_local() if hasattr(loss, "to_local") else loss
        else:
            loss = self.F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        self.optim.step()
        t3 = time.perf_counter()
        if timed:
            self.fwd_s.append(t1 - t0)
            self.bwd_s.append(t2 - t1)
            self.opt_s.append(t3 - t2)
            self.step_s.append(t3 - t0)
            self.cpu_s.append(time.process_time() - c0)
            self.losses.append(float(loss.detach()))


def machine_busy_s():
    """CPU seconds the whole machine was busy (user + nice + system + irq + softirq), /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def worker(rank, world, args, store_path):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        tensors = load_init(args.init)
        layouts = parse_layouts(args.layouts, world)
        runs, errors = [], {}
        for l in layouts:
            try:
                runs.append(Run(l, tensors, rank, world, args.lr))
            except Exception as e:  # noqa: BLE001  reported; the others still run
                errors[l["name"]] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if rank == 0:
            print(f"[torch_tp_bench] {world} processes (Gloo), torch {torch.__version__}; layouts "
                  f"{', '.join(r.layout['name'] for r in runs)}; {args.warmup} warm-up + {args.steps} steps",
                  file=sys.stderr, flush=True)
            for k, v in errors.items():
                print(f"[torch_tp_bench] {k} not run: {v}", file=sys.stderr, flush=True)
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                dist.barrier()
                busy0, own0, w0 = machine_busy_s(), time.process_time(), time.perf_counter()
            for k in range(len(runs)):
                r = runs[(k + i) % len(runs)]
                dist.barrier()
                try:
                    r.step(i, i >= args.warmup)
                except Exception as e:
                    raise RuntimeError(f"layout {r.layout['name']}: {type(e).__name__}: {e}") from e
        dist.barrier()
        wall = time.perf_counter() - w0
        busy = machine_busy_s() - busy0
        own = torch.tensor([time.process_time() - own0], dtype=torch.float64)
        dist.all_reduce(own)
        machine = {"cores": os.cpu_count(), "timing_wall_s": wall, "ranks_cpu_s": own.item(),
                   "machine_busy_cpu_s": busy, "other_processes_cores": (busy - own.item()) / wall,
                   "load1_after": os.getloadavg()[0]}
        out = []
        for r in runs:
            res = {"name": r.layout["name"], **{k: r.layout[k] for k in ("dp", "tp", "sp", "lp")},
                   "batch_per_dp_group": r.batch, "losses_rank0": r.losses}
            for key in ("step_s", "fwd_s", "bwd_s", "opt_s", "cpu_s"):
                t = torch.tensor(getattr(r, key), dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                res[key.replace("_s", "_ms")] = 1e3 * statistics.median(t.tolist())
                if key == "step_s":
                    res["steps_ms"] = [1e3 * x for x in t.tolist()]
            out.append(res)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"program": "torch_tp_bench", "torch": torch.__version__, "world_size": world,
                           "threads": torch.get_num_threads(), "warmup": args.warmup, "steps": args.steps,
                           "qkv": "fused (rows permuted for a contiguous Shard(0) split)",
                           "machine": machine, "layouts": out, "errors": errors}, f)
            print(f"[torch_tp_bench] wrote {args.out}", file=sys.stderr, flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def cmd_run(args):
    with tempfile.TemporaryDirectory(prefix="ttb") as tmp:
        store = os.path.join(tmp, "store")
        if args.world == 1:
            worker(0, 1, args, store)
        else:
            import torch.multiprocessing as mp
            mp.spawn(worker, args=(args.world, args, store), nprocs=args.world)
    return 0


# ---------------------------------------------------------------------------------------------
# report

def mib(b):
    return b / (1024.0 * 1024.0)


def table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def cmd_report(args):
    with open(args.cpp) as f:
        cpp = json.load(f)
    py = None
    if args.py and os.path.exists(args.py):
        with open(args.py) as f:
            py = json.load(f)
    pyl = {l["name"]: l for l in (py or {}).get("layouts", [])}
    machine = cpp.get("machine", {})
    world = cpp["world_size"]
    cores = machine.get("cores", os.cpu_count())
    # Busy: other processes used a noticeable share of the cores while our ranks ran, or the load
    # average exceeded what the run's own ranks explain (one runnable process per rank).
    others = machine.get("other_processes_cores", 0.0)
    py_others = (py or {}).get("machine", {}).get("other_processes_cores")
    # Busy: other processes used a noticeable share of the cores while a side's ranks ran (CPU
    # seconds of the machine minus the ranks' own), or the 1-minute load average at the end of a
    # side's timed steps exceeded what its own ranks explain (one runnable process per rank).
    py_machine = (py or {}).get("machine", {})
    busy_cpp = others > args.busy_cores or machine.get("load1_after", 0) > world + 0.5
    busy_py = py_others is not None and (py_others > args.busy_cores or py_machine.get("load1_after", 0) > world + 0.5)
    mark_cpp = "*" if busy_cpp else ""
    mark_py = "*" if busy_py else ""
    mark = mark_cpp or mark_py

    base = cpp["layouts"][0]
    base_peak = base.get("step_peak_bytes_max")
    rows, merged = [], []
    for l in cpp["layouts"]:
        p = pyl.get(l["name"])
        peak = l.get("step_peak_bytes_max")
        row = [l["name"] + (" SP+LP" if l["sequence_parallel"] else ""), f"{l['step_ms']:.1f}{mark_cpp}",
               f"{p['step_ms']:.1f}{mark_py}" if p else "-", f"{l['step_ms'] / p['step_ms']:.2f}" if p else "-",
               f"{l['cpu_ms']:.0f}/{p['cpu_ms']:.0f}" if p else f"{l['cpu_ms']:.0f}/-",
               f"{mib(peak):.2f}" if peak else "-", f"{peak / base_peak:.3f}" if peak and base_peak else "-"]
        for g in ("tp", "dp"):
            per = l["comm"][g]["per_step"]
            parts = []
            short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
            for kind, e in per.items():
                f = e["formula_bytes"]
                ratio = f"{e['bytes'] / f:.4f}" if f else "no formula"
                calls = "" if e["calls"] == e["formula_calls"] else f" calls {e['calls']:g}/{e['formula_calls']}"
                parts.append(f"{short.get(kind, kind)} {mib(e['bytes']):.3f}/{mib(f):.3f}={ratio}{calls}")
            row.append(", ".join(parts) or "none")
        rows.append(row)
        merged.append({"layout": l["name"], "cpp": l, "torch": p,
                       "step_ratio_cpp_over_torch": l["step_ms"] / p["step_ms"] if p else None,
                       "peak_ratio_vs_first": peak / base_peak if peak and base_peak else None})
    c = cpp["config"]
    print(f"\n== tensor parallel x fully_shard: GPT d_model {c['d_model']}, {c['layers']} layers, {c['heads']} heads, "
          f"vocab {c['vocab']}, context {c['context']}, global batch {c['global_batch']} per step, {world} ranks, "
          f"1 thread each; median of {c['steps']} steps after {c['warmup']} warm-up, slowest rank ==")
    print(table(["layout", "C++ ms", "PyTorch ms", "C++/Py", "CPU ms C++/Py", "peak MiB/rank", "vs " + base["name"],
                 "tp group MiB/step measured/formula=ratio", "dp group MiB/step measured/formula=ratio"], rows))
    print("(step ms: wall, slowest rank, median; CPU ms: process CPU of the step, slowest rank; peak: C++ only, "
          "counting allocator, max over ranks; AG all-gather, RS reduce-scatter, AR all-reduce: payload bytes as "
          "comm/communicator.h counts them (all-gather output, reduce-scatter input, all-reduce tensor), per step, "
          "against the closed forms of tools/bench/tp_bench.cc; calls are shown only where they differ)")
    # Loss check: rank 0 sees dp group 0's batch on both sides.
    for l in cpp["layouts"]:
        p = pyl.get(l["name"])
        if p and l["losses_rank0"] and p["losses_rank0"]:
            print(f"  first measured loss {l['name']}: C++ {l['losses_rank0'][0]:.6f}, PyTorch {p['losses_rank0'][0]:.6f}")
    if py and py.get("errors"):
        for k, v in py["errors"].items():
            print(f"  PyTorch {k}: not run: {v}")
    print(f"load average: before {args.load_before}, after {args.load_after} ({cores} cores; the runs' own "
          f"{world} ranks explain about {world}); other processes used {others:.2f} cores on average during "
          f"the C++ timed steps" + (f", {py_others:.2f} during PyTorch's" if py_others is not None else ""))
    if mark:
        print(f"* taken on a busy machine: other processes used more than {args.busy_cores} cores on average "
              f"while the ranks ran, or the load average exceeded what the runs' own {world} ranks explain "
              f"(above {world + 0.5} at the end of its timed steps); step times are inflated")
    if args.load_before is not None and args.load_before > args.idle_load:
        print(f"note: the load average before the runs was {args.load_before} (> {args.idle_load}: the machine "
              f"was in use, or still counts the build)")
    out = {"definitions": {
        "step_ms": "median over the measured steps of the slowest rank's zero_grad + forward + loss + backward + "
                   "AdamW step, layouts interleaved step by step, a barrier before each step",
        "peak": "C++ only: counting CPU allocator, peak of live bytes over a whole step (forward, backward, "
                "optimizer.step, zero_grad), allocations since the model copy was built, max over ranks",
        "comm": "per step per group and kind: calls and payload bytes (all-gather output, reduce-scatter input, "
                "all-reduce tensor) against the closed forms in tools/bench/tp_bench.cc",
        "busy": "other_processes_cores = (machine busy CPU seconds from /proc/stat - the ranks' process CPU "
                "seconds) / wall seconds of the timed steps"},
        "machine": {"load1_before": args.load_before, "load1_after": args.load_after, "cpp": machine,
                    "torch": (py or {}).get("machine"), "busy_cpp": bool(mark_cpp),
                    "busy_torch": bool(mark_py)},
        "layouts": merged, "raw": {"cpp": cpp, "torch": py}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--init", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--world", type=int, default=4)
    r.add_argument("--layouts", default="4x1,2x2,2x2+sp,1x4,1x4+sp")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--threads", type=int, default=1)
    q = sub.add_parser("report")
    q.add_argument("--cpp", required=True)
    q.add_argument("--py")
    q.add_argument("--out", required=True)
    q.add_argument("--load-before", type=float)
    q.add_argument("--load-after", type=float)
    q.add_argument("--busy-cores", type=float, default=0.25,
                   help="other processes' average cores above which figures are marked busy")
    q.add_argument("--idle-load", type=float, default=1.0,
                   help="load average before the runs above which the machine counts as busy")
    args = p.parse_args()
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
