#!/usr/bin/env python3
"""PyTorch's side of the Llama training-step benchmark (tools/llama_benchmark.sh), the init folder
both sides load, and the report that merges both sides.

    python3 tools/bench/torch_llama_bench.py init --dir DIR [--vocab 512 --hidden 256 --layers 4
        --heads 8 --kv-heads 4 --intermediate 688 --seq 64 --global-batch 8 --batches 16 --seed 0]
    python3 tools/bench/torch_llama_bench.py run --init DIR --out JSON --world W --layouts L
        [--warmup N] [--steps N] [--microbatches M] [--memory 0|1] [--adamw fused|foreach|for-loop]
    python3 tools/bench/torch_llama_bench.py report --dir OUTDIR --out JSON
        [--load-before X --load-after Y]

`init`: DIR/hf, a transformers LlamaForCausalLM (untied, llama3 rope, float32) initialised from
`--seed` and written with save_pretrained (config.json + model.safetensors); DIR/tokens.safetensors,
`tokens` [batches, global batch, seq + 1] int64: sequences of a random sparse Markov chain over the
vocabulary (each token has 4 possible successors), so that the loss falls as the model learns.
The C++ side (tools/bench/llama_bench.cc) loads the same two files (fsdp::models::load_llama_hf,
fsdp::load_safetensors).

`run`: transformers' LlamaForCausalLM loaded with from_pretrained from DIR/hf, trained on the CPU
with Gloo in `--world` processes (torch.multiprocessing), each layout composed as torchtitan's
parallelize_llama + pipeline_llama compose it, in torchtitan's order:
  - the mesh: init_device_mesh("cpu", (pp, dp_shard, tp)), tp fastest (as the C++ ParallelMesh);
  - pipeline (pp > 1): the whole model cut into stages of consecutive decoder layers as
    pipeline::split_blocks_evenly cuts them (embed_tokens on the first stage, norm and lm_head on
    the last; the layers keep their indices), each stage a PipelineStage over mesh["pp"], the
    schedule Schedule1F1B with `--microbatches` microbatches (gradients scaled by 1/m);
  - tensor parallel (tp > 1) with torchtitan's Llama plan on transformers' module names:
    embed_tokens RowwiseParallel (input Replicate, output Replicate), q/k/v_proj and
    gate/up_proj ColwiseParallel, o_proj and down_proj RowwiseParallel, lm_head ColwiseParallel
    (output Shard(-1), use_local_output=False) with loss_parallel(); no sequence parallelism (the
    C++ Llama plan has none);
  - FSDP2 fully_shard over mesh["dp_shard"] on every decoder layer, then the root (the stage's
    module under pp); reshard_after_forward = not pp (torchtitan's "default" policy);
  - AdamW (lr, weight decay, betas (0.9, 0.999), eps 1e-8), `--adamw fused` by default (torchtitan's
    default implementation), one intra-op thread per process.
torchtitan itself is not used: its trainer selects a CUDA device (tools/utils.get_device_info falls
back to "cuda") and trains its own Llama3Model, not transformers'.

Steps are timed as llama_bench times them: the layouts of the run step by step in turn (rotating
order), a world barrier before each step; a step is zero_grad(set_to_none) + forward + loss +
backward (the schedule's step under pp) + AdamW step; the slowest rank's wall time. The global
batch's mean loss is reduced over the data ranks after each step, outside the timed region.
Memory (`--memory 1` with `--allocator-lib`, after the timings): the project's counting allocator
(tools/bench/counting_allocator.h, the C++ side's instrument) is installed over torch's CPU
allocator in each process through //tools/bench:libcounting_allocator_capi.so (ctypes; built
against the same LibTorch as this torch), then each layout is built anew (mark() right before
from_pretrained) and trained 2 warm-up + 3 measured steps; the step peak is the allocator's peak of
live bytes allocated since the mark, over a whole step (reset_peak() before the step, read after
optimizer.step() and zero_grad(set_to_none)), the largest of the 3, per rank: the same figure as
llama_bench's, counted the same way.

`report`: reads llama_cpp_dp2.json, llama_cpp_w4.json, llama_torch_dp2.json, llama_torch_w4.json
from --dir and prints one table (tools/bench/README.md, "Llama training step", says what each
figure measures).
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


def parse_layout(name):
    """'dp2', 'dp2xtp2', 'pp2xdp2' -> {'pp':, 'dp':, 'tp':}."""
    dims = {"pp": 1, "dp": 1, "tp": 1}
    for part in name.split("x"):
        key, value = part[:2], part[2:]
        if key not in dims or not value.isdigit():
            raise ValueError(f"layout {name}: expected parts ppN, dpN, tpN joined by 'x'")
        dims[key] = int(value)
    return {"name": name, **dims}


def split_blocks_evenly(n_blocks, n_stages):
    base, extra = divmod(n_blocks, n_stages)
    out, begin = [], 0
    for s in range(n_stages):
        end = begin + base + (1 if s < extra else 0)
        out.append((begin, end))
        begin = end
    return out


def quiet_transformers():
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def machine_busy_s():
    """CPU seconds the whole machine was busy (user + nice + system + irq + softirq), /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def load1():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


# ---------------------------------------------------------------------------------------------
# init

def cmd_init(a):
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    torch.manual_seed(a.seed)
    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=max(2048, a.seq),
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    model = LlamaForCausalLM(config).float()
    os.makedirs(a.dir, exist_ok=True)
    model.save_pretrained(os.path.join(a.dir, "hf"))
    # Data: a sparse random Markov chain (4 successors per token), so the loss can fall.
    g = torch.Generator().manual_seed(a.seed + 1)
    successors = torch.randint(0, a.vocab, (a.vocab, 4), generator=g)
    n = a.batches * a.global_batch
    seq = torch.empty(n, a.seq + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, a.vocab, (n,), generator=g)
    for t in range(1, a.seq + 1):
        pick = torch.randint(0, 4, (n,), generator=g)
        seq[:, t] = successors[seq[:, t - 1], pick]
    tokens = seq.view(a.batches, a.global_batch, a.seq + 1).contiguous()
    save_file({"tokens": tokens}, os.path.join(a.dir, "tokens.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(f"[torch_llama_bench] wrote {a.dir}/hf (Llama: {a.layers} layers, hidden {a.hidden}, {a.heads} heads "
          f"({a.kv_heads} kv), intermediate {a.intermediate}, vocab {a.vocab}, {params / 1e6:.2f}M parameters) and "
          f"{a.dir}/tokens.safetensors [{a.batches}, {a.global_batch}, {a.seq + 1}]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# run

def make_stage_class():
    import torch
    import torch.nn as nn

    class LlamaStage(nn.Module):
        """One pipeline stage of a transformers LlamaForCausalLM: its modules, moved here (torchtitan's
        pipeline_llama prunes a copy of the whole model the same way); forward as LlamaModel's
        (rotary embeddings, causal attention without a mask: sdpa's is_causal)."""

        def __init__(self, full, begin, end, first, last):
            super().__init__()
            self.embed_tokens = full.model.embed_tokens if first else None
            self.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in range(begin, end)})
            self.rotary_emb = full.model.rotary_emb
            self.norm = full.model.norm if last else None
            self.lm_head = full.lm_head if last else None

        def forward(self, x):
            h = self.embed_tokens(x) if self.embed_tokens is not None else x
            position_ids = torch.arange(h.shape[1]).unsqueeze(0)
            position_embeddings = self.rotary_emb(h, position_ids=position_ids)
            for layer in self.layers.values():
                h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
            if self.norm is not None:
                h = self.lm_head(self.norm(h))
            return h

    return LlamaStage


class Run:
    def __init__(self, layout, a, rank, world):
        import torch
        import torch.nn.functional as F
        from safetensors.torch import load_file
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import LlamaForCausalLM

        self.layout = layout
        pp, dp, tp = layout["pp"], layout["dp"], layout["tp"]
        if pp * dp * tp != world:
            raise ValueError(f"layout {layout['name']}: {pp * dp * tp} ranks, the world has {world}")
        self.mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp_shard", "tp"))
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.dp_rank = self.mesh["dp_shard"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        full = LlamaForCausalLM.from_pretrained(os.path.join(a.init, "hf"), dtype=torch.float32,
                                                attn_implementation="sdpa")
        full.train()
        self.config = full.config
        n_layers = full.config.num_hidden_layers
        self.first = self.pp_rank == 0
        self.last = self.pp_rank == pp - 1
        if pp > 1:
            begin, end = split_blocks_evenly(n_layers, pp)[self.pp_rank]
            module = make_stage_class()(full, begin, end, self.first, self.last)
            layers = list(module.layers.values())
            prefix = ""
        else:
            module = full
            layers = list(full.model.layers)
            prefix = "model."
        del full
        if tp > 1:
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            tp_mesh = self.mesh["tp"]
            plan = {}
            if self.first:
                plan[prefix + "embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            if self.last:
                plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                  use_local_output=False)
            parallelize_module(module, tp_mesh, plan)
            for layer in layers:
                parallelize_module(layer, tp_mesh, {
                    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel()})
        if dp > 1:
            from torch.distributed.fsdp import fully_shard
            reshard = pp == 1  # torchtitan: no reshard after forward under pipeline parallelism
            for layer in layers:
                fully_shard(layer, mesh=self.mesh["dp_shard"], reshard_after_forward=reshard)
            fully_shard(module, mesh=self.mesh["dp_shard"], reshard_after_forward=reshard)
        self.module = module
        kw = {"lr": a.lr, "weight_decay": a.weight_decay, "betas": (0.9, 0.999), "eps": 1e-8}
        if a.adamw == "fused":
            kw["fused"] = True
        elif a.adamw == "foreach":
            kw["foreach"] = True
        else:
            kw["foreach"] = False
        self.optim = torch.optim.AdamW(module.parameters(), **kw)
        self.F = F

        def ce(out, y):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        self.sched = None
        if pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B
            stage = PipelineStage(module, self.pp_rank, pp, torch.device("cpu"), group=self.mesh["pp"].get_group())
            self.sched = Schedule1F1B(stage, n_microbatches=a.microbatches, loss_fn=ce)
        tokens = load_file(os.path.join(a.init, "tokens.safetensors"))["tokens"]
        self.batch = tokens.shape[1] // dp
        self.tokens = tokens[:, self.dp_rank * self.batch:(self.dp_rank + 1) * self.batch].contiguous()
        self.seq = tokens.shape[2] - 1
        self.step_s, self.fwd_s, self.bwd_s, self.opt_s, self.cpu_s, self.losses = [], [], [], [], [], []

    def step(self, i, timed):
        import torch
        w = self.tokens[i % self.tokens.shape[0]]
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.optim.zero_grad(set_to_none=True)
        loss = None
        if self.sched is not None:
            losses = []
            if self.first:
                self.sched.step(x)
            elif self.last:
                self.sched.step(target=y, losses=losses)
            else:
                self.sched.step()
            if losses:
                loss = torch.stack([l.detach() for l in losses]).mean()
            t1 = t2 = time.perf_counter()
        else:
            logits = self.module(input_ids=x, use_cache=False).logits
            if self.layout["tp"] > 1:
                from torch.distributed.tensor.parallel import loss_parallel
                with loss_parallel():
                    loss = self.F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
                    t1 = time.perf_counter()
                    loss.backward()
                loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            else:
                loss = self.F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                t1 = time.perf_counter()
                loss.backward()
            loss = loss.detach()
            t2 = time.perf_counter()
        self.optim.step()
        t3 = time.perf_counter()
        if timed:
            self.fwd_s.append(t1 - t0)
            self.bwd_s.append(t2 - t1)
            self.opt_s.append(t3 - t2)
            self.step_s.append(t3 - t0)
            self.cpu_s.append(time.process_time() - c0)
        return loss

    def global_loss(self, loss):
        """The global batch's mean loss on every rank (outside the timed region)."""
        import torch
        import torch.distributed as dist
        v = torch.zeros(1, dtype=torch.float64)
        if loss is not None and self.last and self.tp_rank == 0:
            v += float(loss) / self.layout["dp"]
        dist.all_reduce(v)
        return float(v)


def counting_allocator(path):
    """The project's counting allocator (tools/bench/counting_allocator.h) installed over torch's CPU
    allocator in this process, through //tools/bench:libcounting_allocator_capi.so (ctypes)."""
    import ctypes
    lib = ctypes.CDLL(path)
    for name in ("fsdp_counting_current_since_mark", "fsdp_counting_peak_since_mark", "fsdp_counting_current"):
        getattr(lib, name).restype = ctypes.c_int64
    lib.fsdp_counting_install()
    return lib


def memory_of_layout(layout, a, rank, world, lib):
    """Step peaks (bytes) of a fresh copy of `layout`, counted as llama_bench counts them: mark()
    before the model is loaded, reset_peak() right before each measured step's forward, the peak
    since the mark read after optimizer.step() and zero_grad()."""
    import gc
    gc.collect()
    lib.fsdp_counting_mark()
    run = Run(layout, a, rank, world)
    peaks = []
    for i in range(5):
        if i >= 2:
            lib.fsdp_counting_reset_peak()
        run.step(i, False)
        run.optim.zero_grad(set_to_none=True)
        if i >= 2:
            peaks.append(int(lib.fsdp_counting_peak_since_mark()))
    held = int(lib.fsdp_counting_current_since_mark())
    del run
    gc.collect()
    return max(peaks), peaks, held


def worker(rank, world, a, store_path):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    quiet_transformers()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        layouts = [parse_layout(x) for x in filter(None, a.layouts.split(","))]
        runs, errors = [], {}
        for l in layouts:
            try:
                runs.append(Run(l, a, rank, world))
            except Exception as e:  # noqa: BLE001  reported; the others still run
                errors[l["name"]] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if rank == 0:
            print(f"[torch_llama_bench] {world} processes (Gloo), torch {torch.__version__}; layouts "
                  f"{', '.join(r.layout['name'] for r in runs)}; {a.warmup} warm-up + {a.steps} steps",
                  file=sys.stderr, flush=True)
            for k, v in errors.items():
                print(f"[torch_llama_bench] {k} not run: {v}", file=sys.stderr, flush=True)
        global_losses = {r.layout["name"]: [] for r in runs}
        load_before = load1()
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                dist.barrier()
                busy0, own0, w0 = machine_busy_s(), time.process_time(), time.perf_counter()
            for k in range(len(runs)):
                r = runs[(k + i) % len(runs)]
                dist.barrier()
                try:
                    loss = r.step(i, i >= a.warmup)
                except Exception as e:
                    raise RuntimeError(f"layout {r.layout['name']}: {type(e).__name__}: {e}") from e
                g = r.global_loss(loss)
                if i >= a.warmup:
                    global_losses[r.layout["name"]].append(g)
        dist.barrier()
        wall = time.perf_counter() - w0
        busy = machine_busy_s() - busy0
        own = torch.tensor([time.process_time() - own0], dtype=torch.float64)
        dist.all_reduce(own)
        machine = {"cores": os.cpu_count(), "timing_wall_s": wall, "ranks_cpu_s": own.item(),
                   "machine_busy_cpu_s": busy, "other_processes_cores": (busy - own.item()) / wall,
                   "load1_before": load_before, "load1_after": load1()}
        out = []
        for r in runs:
            tokens = r.batch * r.layout["dp"] * r.seq
            res = {"name": r.layout["name"], **{k: r.layout[k] for k in ("pp", "dp", "tp")},
                   "microbatches": a.microbatches if r.layout["pp"] > 1 else 1,
                   "batch_per_data_rank": r.batch, "tokens_per_step": tokens,
                   "global_losses": global_losses[r.layout["name"]]}
            for key in ("step_s", "fwd_s", "bwd_s", "opt_s", "cpu_s"):
                t = torch.tensor(getattr(r, key), dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                res[key.replace("_s", "_ms")] = 1e3 * statistics.median(t.tolist())
                if key == "step_s":
                    res["steps_ms"] = [1e3 * x for x in t.tolist()]
            res["tokens_per_s_per_rank"] = tokens / (res["step_ms"] / 1e3) / world
            out.append(res)
        names = [r.layout["name"] for r in runs]
        runs.clear()
        if a.memory and not a.allocator_lib:
            if rank == 0:
                print("[torch_llama_bench] no --allocator-lib: memory not measured", file=sys.stderr, flush=True)
        elif a.memory:
            lib = counting_allocator(a.allocator_lib)
            for res, name in zip(out, names):
                if rank == 0:
                    print(f"[torch_llama_bench] memory: {name}", file=sys.stderr, flush=True)
                peak, peaks, held = memory_of_layout(parse_layout(name), a, rank, world, lib)
                t = torch.zeros(world, dtype=torch.float64)
                t[rank] = peak
                dist.all_reduce(t)
                res["step_peak_bytes_per_rank"] = [int(x) for x in t.tolist()]
                res["step_peak_bytes_max"] = int(t.max())
                if rank == 0:
                    res["step_peaks_rank0"] = peaks
                    res["held_between_steps_bytes_rank0"] = held
        if rank == 0:
            with open(a.out, "w") as f:
                json.dump({"program": "torch_llama_bench", "torch": torch.__version__, "world_size": world,
                           "threads": torch.get_num_threads(), "warmup": a.warmup, "steps": a.steps,
                           "adamw": a.adamw, "machine": machine, "layouts": out, "errors": errors}, f, indent=1)
            print(f"[torch_llama_bench] wrote {a.out}", file=sys.stderr, flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def cmd_run(a):
    with tempfile.TemporaryDirectory(prefix="tlb") as tmp:
        store = os.path.join(tmp, "store")
        if a.world == 1:
            worker(0, 1, a, store)
        else:
            import torch.multiprocessing as mp
            mp.spawn(worker, args=(a.world, a, store), nprocs=a.world)
    return 0


# ---------------------------------------------------------------------------------------------
# report

def mib(b):
    return b / (1024.0 * 1024.0)


def table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def load_json(d, name):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def busy(machine, world, cores_threshold):
    if not machine:
        return False
    return machine.get("other_processes_cores", 0) > cores_threshold or machine.get("load1_after", 0) > world + 0.5


def cmd_report(a):
    cpp_runs = [x for x in (load_json(a.dir, "llama_cpp_dp2.json"), load_json(a.dir, "llama_cpp_w4.json")) if x]
    py_runs = [x for x in (load_json(a.dir, "llama_torch_dp2.json"), load_json(a.dir, "llama_torch_w4.json")) if x]
    if not cpp_runs:
        print("llama benchmark: no C++ results in " + a.dir, file=sys.stderr)
        return 1
    py_by = {}
    for p in py_runs:
        for l in p["layouts"]:
            py_by[l["name"]] = (l, p)
    c = cpp_runs[0]["config"]
    rows, comm_rows, loss_rows, merged, verdicts = [], [], [], [], []
    any_busy = False
    for run in cpp_runs:
        world = run["world_size"]
        busy_c = busy(run.get("machine"), world, a.busy_cores)
        for l in run["layouts"]:
            p, prun = py_by.get(l["name"], (None, None))
            busy_p = busy(prun.get("machine") if prun else None, world, a.busy_cores)
            any_busy = any_busy or busy_c or busy_p
            mc, mp_ = "*" if busy_c else "", "*" if busy_p else ""
            ratio = l["tokens_per_s_per_rank"] / p["tokens_per_s_per_rank"] if p else None
            pk, ppk = l.get("step_peak_bytes_max"), (p or {}).get("step_peak_bytes_max")
            rows.append([l["name"], world, l["microbatches"], f"{l['step_ms']:.1f}{mc}",
                         f"{p['step_ms']:.1f}{mp_}" if p else "-",
                         f"{l['tokens_per_s_per_rank']:.0f}", f"{p['tokens_per_s_per_rank']:.0f}" if p else "-",
                         f"{ratio:.2f}" if ratio else "-",
                         f"{l['cpu_ms']:.0f}/{p['cpu_ms']:.0f}" if p else f"{l['cpu_ms']:.0f}/-",
                         f"{mib(pk):.2f}" if pk else "-", f"{mib(ppk):.2f}" if ppk else "-",
                         f"{pk / ppk:.2f}" if pk and ppk else "-"])
            if ratio is not None:
                verdicts.append((l["name"], ratio))
            for g, e in l["comm"].items():
                for kind, v in e["per_step"].items():
                    f = v.get("formula_bytes")
                    comm_rows.append([l["name"], g, e["size"], kind, f"{v['calls']:g}",
                                      f"{v['formula_calls']}", f"{v['bytes']:.0f}",
                                      f"{f}" if f is not None else "no closed form",
                                      f"{v['bytes'] / f:.4f}" if f else ("-" if f is None else "n/a"),
                                      ("=" if e["every_rank_matches_formula"] else "MISMATCH") +
                                      ("" if e["same_on_all_ranks"] else " (ranks differ: rank 0's shown)")])
            lc = l["global_losses"][-1] if l["global_losses"] else None
            lp = p["global_losses"][-1] if p and p["global_losses"] else None
            first_c = l["global_losses"][0] if l["global_losses"] else None
            first_p = p["global_losses"][0] if p and p["global_losses"] else None
            diff = abs(lc - lp) if lc is not None and lp is not None else None
            loss_rows.append([l["name"], f"{first_c:.6f}" if first_c is not None else "-",
                              f"{first_p:.6f}" if first_p is not None else "-",
                              f"{lc:.6f}" if lc is not None else "-", f"{lp:.6f}" if lp is not None else "-",
                              f"{diff:.2e}" if diff is not None else "-",
                              ("ok" if diff <= a.loss_tolerance else "MISMATCH") if diff is not None else "-"])
            merged.append({"layout": l["name"], "cpp": l, "torch": p, "tokens_per_s_ratio_cpp_over_torch": ratio,
                           "last_loss_abs_diff": diff, "busy_cpp": busy_c, "busy_torch": busy_p})
    steps = cpp_runs[0]["config"]["steps"]
    print(f"\n== Llama training step, C++ (parallelize(llama_model_spec)) against PyTorch (transformers "
          f"LlamaForCausalLM + FSDP2 + DTensor TP + pipelining, Gloo): {c['layers']} layers, hidden {c['hidden']}, "
          f"{c['heads']} heads ({c['kv_heads']} kv), intermediate {c['intermediate']}, vocab {c['vocab']}, seq "
          f"{c['seq']}, global batch {c['global_batch']} ({c['global_batch'] * c['seq']} tokens per step), float32, "
          f"AdamW, 1 thread per process; median of {steps} steps after {c['warmup']} warm-up, slowest rank ==")
    print(table(["layout", "ranks", "mbs", "C++ ms", "PyTorch ms", "C++ tok/s/rank", "Py tok/s/rank",
                 "C++/Py tok/s", "CPU ms C++/Py", "C++ peak MiB", "Py peak MiB", "peak C++/Py"], rows))
    print("(step ms: wall, slowest rank, median; tokens/s per rank: tokens per step / step time / ranks; CPU ms: "
          "process CPU of the step, slowest rank; peak: allocator peak of live bytes over a whole step, max over "
          "ranks, both sides counted by tools/bench/counting_allocator.h over the CPU allocator)")
    print("\nC++ collectives per step (payload bytes per call summed, comm/communicator.h) against the closed forms "
          "of tools/bench/llama_bench.cc:")
    print(table(["layout", "group", "size", "kind", "calls", "formula", "bytes", "formula", "ratio",
                 "every rank vs its formula"], comm_rows))
    print("(rank 0's counts per step; '=': every rank's calls, and bytes where a closed form exists, equal its own "
          "formula; the stages of a pipeline hold different units, so their dp_shard counts differ)")
    print("\nloss of the global batch (mean over its tokens), first and last measured step; the same weights and "
          "data on both sides:")
    print(table(["layout", "C++ first", "PyTorch first", "C++ last", "PyTorch last", "|diff| last",
                 f"<= {a.loss_tolerance:g}"], loss_rows))
    for p in py_runs:
        for k, v in (p.get("errors") or {}).items():
            print(f"  PyTorch {k}: not run: {v}")
    mach = []
    for name, r in [("C++ " + ",".join(l["name"] for l in x["layouts"]), x) for x in cpp_runs] + \
                   [("PyTorch " + ",".join(l["name"] for l in x["layouts"]), x) for x in py_runs]:
        m = r.get("machine", {})
        mach.append(f"{name}: {m.get('other_processes_cores', 0):.2f} cores used by other processes, load "
                    f"{m.get('load1_before', float('nan')):.2f} -> {m.get('load1_after', float('nan')):.2f}")
    print(f"\nload average before the runs {a.load_before}, after {a.load_after} "
          f"({cpp_runs[0].get('machine', {}).get('cores', os.cpu_count())} cores); during each run's timed steps:")
    for line in mach:
        print("  " + line)
    if any_busy:
        print(f"* taken on a BUSY machine: other processes used more than {a.busy_cores} cores on average during that "
              f"side's timed steps, or the load average at their end exceeded what its own ranks explain; step times "
              f"are inflated, rerun on an idle machine")
    elif a.load_before is not None and a.load_before > a.idle_load:
        print(f"note: the load average before the runs was {a.load_before} (> {a.idle_load}: the machine was in use, "
              f"or still counts the build)")
    if verdicts:
        met = all(r >= 1.0 for _, r in verdicts)
        print("goal (C++ tokens/s >= PyTorch's at every layout): " + ("MET" if met else "NOT MET") + " (" +
              ", ".join(f"{n} {r:.2f}x" for n, r in verdicts) + ")")
    out = {"definitions": {
        "step_ms": "median over the measured steps of the slowest rank's zero_grad + forward + loss + backward + "
                   "AdamW step, the layouts of one run interleaved step by step, a barrier before each step",
        "tokens_per_s_per_rank": "global batch x sequence length / step time / ranks",
        "peak": "counting_allocator's peak of live bytes over a whole step (forward, backward, optimizer.step, "
                "zero_grad), allocations since that copy of the model began to be built, max over ranks; the same "
                "allocator installed in the Python processes through libcounting_allocator_capi.so",
        "comm": "C++ only: per step per group and kind, calls and payload bytes (all-gather output, reduce-scatter "
                "input, all-reduce tensor, send/recv tensor) against the closed forms in llama_bench.cc",
        "busy": "other_processes_cores = (machine busy CPU seconds from /proc/stat - the ranks' process CPU "
                "seconds) / wall seconds of the timed steps"},
        "load1_before": a.load_before, "load1_after": a.load_after, "layouts": merged,
        "raw": {"cpp": cpp_runs, "torch": py_runs}}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init")
    i.add_argument("--dir", required=True)
    i.add_argument("--vocab", type=int, default=512)
    i.add_argument("--hidden", type=int, default=256)
    i.add_argument("--layers", type=int, default=4)
    i.add_argument("--heads", type=int, default=8)
    i.add_argument("--kv-heads", type=int, default=4)
    i.add_argument("--intermediate", type=int, default=688)
    i.add_argument("--seq", type=int, default=64)
    i.add_argument("--global-batch", type=int, default=8)
    i.add_argument("--batches", type=int, default=16)
    i.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("--init", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--world", type=int, default=4)
    r.add_argument("--layouts", default="dp2xtp2,pp2xdp2")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--microbatches", type=int, default=4)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--weight-decay", type=float, default=0.1)
    r.add_argument("--memory", type=int, default=1)
    r.add_argument("--allocator-lib", help="//tools/bench:libcounting_allocator_capi.so (memory is measured "
                   "with it; without it, not at all)")
    r.add_argument("--adamw", choices=["fused", "foreach", "for-loop"], default="fused")
    q = sub.add_parser("report")
    q.add_argument("--dir", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--load-before", type=float)
    q.add_argument("--load-after", type=float)
    q.add_argument("--busy-cores", type=float, default=0.25)
    q.add_argument("--idle-load", type=float, default=1.0)
    q.add_argument("--loss-tolerance", type=float, default=1e-4)
    a = p.parse_args()
    return {"init": cmd_init, "run": cmd_run, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
