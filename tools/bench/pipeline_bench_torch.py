#!/usr/bin/env python3
"""PyTorch's side of the pipeline benchmark (tools/pipeline_benchmark.sh), and the report that prints
every table of the run.

    python3 tools/bench/pipeline_bench_torch.py run --world W --pp P --dp D --configs gpipe:4,1f1b:4
        --out JSON [--optimizer] [--warmup N] [--steps N] [model flags as pipeline_bench]
    python3 tools/bench/pipeline_bench_torch.py report --dir OUTDIR --out JSON
        [--load-before X --load-after Y]

`run`: the untied GPT of examples/gpt_model.h in Python (pre-LayerNorm, fused qkv, GELU tanh MLP,
learned positions, its own output layer `head` without bias), cut into P stages of consecutive
blocks as pipeline::split_blocks_evenly cuts it (the first n % P stages one block more; the
embeddings on the first stage, ln_f and head on the last), run by
torch.distributed.pipelining (PipelineStage, ScheduleGPipe / Schedule1F1B) over Gloo on the CPU in W
processes (torch.multiprocessing), a DeviceMesh("cpu", (P, D), ("pp", "dp")); with D > 1 FSDP2's
fully_shard on every block and on each stage's module over mesh["dp"]. Weights are drawn from the
same seed but not copied from the C++ side: the figures are step times, not losses. Timed as
pipeline_bench times them: a barrier before each step, the slowest rank's wall time; without
--optimizer the schedule's step() alone (gradients set to none before it, untimed), with
--optimizer zero_grad + step() + AdamW step. A failure (e.g. PyTorch's pipelining refusing CPU/Gloo)
is written to the JSON as `error` and printed as one line instead of figures.

`report`: reads pipeline_pp2.json, pipeline_pp4.json, compare_w4.json, compare_local.json (the C++
program's) and torch_pp2.json, torch_pp2dp2.json (this program's) from --dir, prints the tables and
writes the merged JSON. tools/bench/README.md says what each figure measures.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

warnings.filterwarnings("ignore")

BUSY_CORES = 0.25  # other processes' average cores above which a figure is marked BUSY


def machine_busy_s():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, idle, iowait, irq, softirq = v
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def load1():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def split_blocks_evenly(n_blocks, n_stages):
    base, extra = divmod(n_blocks, n_stages)
    out, begin = [], 0
    for s in range(n_stages):
        end = begin + base + (1 if s < extra else 0)
        out.append((begin, end))
        begin = end
    return out


def build_stage(a, stage, n_stages):
    import torch
    import torch.nn as nn

    # The main benchmark's GPT block (tools/bench/torch_bench.py): the same model as the C++ side.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_bench import Block

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            begin, end = split_blocks_evenly(a.layers, n_stages)[stage]
            self.first, self.last = stage == 0, stage == n_stages - 1
            if self.first:
                self.tok_emb = nn.Embedding(a.vocab, a.d_model)
                self.pos_emb = nn.Embedding(a.context, a.d_model)
            self.blocks = nn.ModuleList(Block(a.d_model, a.heads, 4) for _ in range(begin, end))
            if self.last:
                self.ln_f = nn.LayerNorm(a.d_model)
                self.head = nn.Linear(a.d_model, a.vocab, bias=False)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, 0.0, 0.02)

        def forward(self, x):
            if self.first:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            if self.last:
                x = self.head(self.ln_f(x))
            return x

    torch.manual_seed(a.seed + stage)
    return Stage()


def worker(rank, a, store_path):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    # A short timeout: a configuration that fails on one rank ends the others' waits within it.
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    result = {"configs": []}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        mesh = init_device_mesh("cpu", (a.pp, a.dp), mesh_dim_names=("pp", "dp"))
        pp_rank = mesh["pp"].get_local_rank()
        dp_rank = mesh["dp"].get_local_rank()
        torch.manual_seed(a.seed + 1)
        tokens = torch.randint(0, a.vocab, (4, a.global_batch, a.context + 1))
        rows = a.global_batch // a.dp

        def loss_fn(out, y):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        for cfg in filter(None, a.configs.split(",")):
            name, m = cfg.split(":")
            m = int(m)
            entry = {"schedule": name, "m": m, "pp": a.pp, "dp": a.dp}
            try:
                module = build_stage(a, pp_rank, a.pp)
                if a.dp > 1:
                    from torch.distributed.fsdp import fully_shard

                    for blk in module.blocks:
                        fully_shard(blk, mesh=mesh["dp"])
                    fully_shard(module, mesh=mesh["dp"])
                stage = PipelineStage(module, pp_rank, a.pp, torch.device("cpu"), group=mesh["pp"].get_group())
                cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
                sched = cls(stage, n_microbatches=m, loss_fn=loss_fn)
                opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01) if a.optimizer else None
                times, cpus, losses = [], [], []
                busy0 = own0 = w0 = 0
                for i in range(a.warmup + a.steps):
                    if i == a.warmup:
                        dist.barrier()
                        busy0, own0, w0 = machine_busy_s(), time.process_time(), time.perf_counter()
                    window = tokens[i % tokens.shape[0]][dp_rank * rows:(dp_rank + 1) * rows]
                    x, y = window[:, :-1].contiguous(), window[:, 1:].contiguous()
                    if opt is None:
                        module.zero_grad(set_to_none=True)
                    dist.barrier()
                    c0, t0 = time.process_time(), time.perf_counter()
                    if opt is not None:
                        opt.zero_grad(set_to_none=True)
                    out_losses = []
                    if pp_rank == 0:
                        sched.step(x)
                    elif pp_rank == a.pp - 1:
                        sched.step(target=y, losses=out_losses)
                    else:
                        sched.step()
                    if opt is not None:
                        opt.step()
                    t1 = time.perf_counter()
                    if i >= a.warmup:
                        times.append(t1 - t0)
                        cpus.append(time.process_time() - c0)
                        if out_losses:
                            losses.append(float(torch.stack(out_losses).mean()))
                dist.barrier()
                wall = time.perf_counter() - w0
                busy = machine_busy_s() - busy0
                t = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                c = torch.tensor(cpus, dtype=torch.float64)
                dist.all_reduce(c, op=dist.ReduceOp.MAX)
                own = torch.tensor([time.process_time() - own0], dtype=torch.float64)
                dist.all_reduce(own)
                entry.update({
                    "step_ms": 1e3 * statistics.median(t.tolist()),
                    "cpu_ms": 1e3 * statistics.median(c.tolist()),
                    "steps_ms": [1e3 * v for v in t.tolist()],
                    "losses_last_stage": losses,
                    "phase": {"wall_s": wall, "ranks_cpu_s": float(own), "machine_busy_cpu_s": busy,
                              "other_processes_cores": (busy - float(own)) / wall, "load1_after": load1()},
                })
            except Exception as e:  # noqa: BLE001  reported as one line; the other configs still run
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if rank == 0:
                    traceback.print_exc()
            result["configs"].append(entry)
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def cmd_run(a):
    import torch
    import torch.multiprocessing as mp

    assert a.pp * a.dp == a.world, "pp x dp must be the world size"
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(worker, args=(a, os.path.join(d, "store")), nprocs=a.world, join=True)
        except Exception as e:  # noqa: BLE001
            with open(a.out, "w") as f:
                json.dump({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           "torch": torch.__version__}, f)
    with open(a.out) as f:
        r = json.load(f)
    r["torch"] = torch.__version__
    with open(a.out, "w") as f:
        json.dump(r, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------------------
# report

def load(d, name):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def busy_mark(phase):
    if not phase:
        return ""
    return " BUSY" if phase.get("other_processes_cores", 0) > BUSY_CORES else ""


def table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
    print(line(header))
    for r in rows:
        print(line(r))


def kib(b):
    return f"{b / 1024:.0f} KiB" if b < 1 << 20 else f"{b / (1 << 20):.2f} MiB"


def slowest_step_ms(case):
    return 1e3 * max(r["step_s"] for r in case["ranks"])


def cmd_report(a):
    pp = {p: load(a.dir, f"pipeline_pp{p}.json") for p in (2, 4)}
    cmp4, local = load(a.dir, "compare_w4.json"), load(a.dir, "compare_local.json")
    tpp2, tdp = load(a.dir, "torch_pp2.json"), load(a.dir, "torch_pp2dp2.json")
    cfg = next((x["config"] for x in (pp[2], pp[4], cmp4) if x), {})
    cores = next((x["cores"] for x in (pp[2], pp[4], cmp4) if x), os.cpu_count())
    print(f"\n== pipeline benchmark: GPT (untied) vocab {cfg.get('vocab')} context {cfg.get('context')} "
          f"d_model {cfg.get('d_model')} heads {cfg.get('heads')} layers {cfg.get('layers')}, global batch "
          f"{cfg.get('global_batch')}, one intra-op thread per process, {cores} cores; median of "
          f"{cfg.get('steps')} steps after {cfg.get('warmup')} warm-up ==")

    # 1. Bubble
    print("\n1. Bubble fraction (measured: 1 - sum over ranks of time inside forwards/backwards / (p x slowest "
          "rank's step wall time); closed form (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1), v=2; simulated: "
          "simulate_schedule(backward_cost=2); cores idle: 1 - ranks' process CPU / (min(p, cores) x step wall))")
    rows = []
    for p in (2, 4):
        if not pp[p]:
            continue
        for c in pp[p]["cases"]:
            per_rank = [r["bubble"] for r in c["ranks"]]
            mark = busy_mark(c.get("phase"))
            if p > cores:
                mark += f" TIME-SHARED({p} ranks/{cores} cores)"
            rows.append([c["schedule"], p, c["m"], f"{c['measured_bubble']:.3f}", f"{c['closed_form_bubble']:.3f}",
                         f"{c['simulated_bubble_backward_cost_2']:.3f}", f"{c['cores_idle_fraction']:.3f}",
                         f"{min(per_rank):.2f}..{max(per_rank):.2f}", f"{slowest_step_ms(c):.1f}",
                         f"{1e3 * statistics.mean(r['compute_s'] for r in c['ranks']):.1f}",
                         f"{1e3 * statistics.mean(r['wait_s'] for r in c['ranks']):.1f}",
                         f"{c['phase']['other_processes_cores']:.2f}" + mark])
        for s in pp[p].get("skipped", []):
            print(f"   (pp={p} skipped: {s})")
    table(["schedule", "pp", "m", "measured", "closed", "simulated", "cores idle", "per rank", "step ms",
           "compute ms", "wait ms", "others' cores"], rows)
    if pp[4]:
        print(f"   pp=4 runs 4 processes on {cores} cores: a rank's forwards and backwards take longer in wall time while "
              "another rank computes on its core, and a rank waiting in the bubble lends its core to another, so the "
              "wall-clock 'measured' bubble of pp=4 is not the schedule's; 'cores idle' is the share of the machine's "
              "cores left unused during the step.")

    # 2. Memory
    print("\n2. Activation memory per stage at m=8 (counting CPU allocator; peak: bytes allocated during a step and "
          "live at once; grads: the stage's gradients, allocated in the step; per mb: bytes one microbatch's forward "
          "leaves held on the stage, received input + saved tensors + output (+ loss); expected: peak live "
          "microbatches x per mb)")
    rows = []
    for p in (2, 4):
        if not pp[p]:
            continue
        for mem in pp[p]["memory"]:
            for r in mem["ranks"]:
                act = r["peak_minus_gradients_bytes"]
                held = r["held_per_microbatch_bytes"]
                single = mem["stages_per_rank"] == 1
                expected = r["peak_live_microbatches"] * held if single else None
                formula = {"gpipe": mem["m"], "1f1b": min(p - r["rank"], mem["m"])}.get(mem["schedule"], "-")
                rows.append([mem["schedule"], p, mem["m"], r["rank"], r["peak_live_microbatches"], formula,
                             kib(held), kib(r["step_peak_bytes"]), kib(r["gradient_bytes"]), kib(act),
                             kib(expected) if expected else "-",
                             f"{act / expected:.2f}" if expected else "-"])
    table(["schedule", "pp", "m", "rank", "live mbs", "formula", "per mb", "step peak", "grads", "peak-grads",
           "expected", "ratio"], rows)

    # 3. Point-to-point bytes
    print("\n3. Point-to-point bytes sent per step per rank (kSend counters of the pipeline group over the measured "
          "steps / steps; StepStats::send_bytes of the last step; formula: per stage held, m x microbatch activation "
          "bytes to the next stage and m x the same to the previous one (its gradient) where that stage is on "
          "another rank)")
    rows, mismatches = [], []
    for p in (2, 4):
        if not pp[p]:
            continue
        for c in pp[p]["cases"]:
            for r in c["ranks"]:
                ok = r["send_bytes_per_step"] == r["formula_send_bytes"] == r["send_bytes_stats"]
                if not ok:
                    mismatches.append(f"{c['schedule']} pp={p} m={c['m']} rank {r['rank']}")
                if c["m"] == 8:
                    rows.append([c["schedule"], p, c["m"], r["rank"], kib(c["microbatch_activation_bytes"]),
                                 f"{r['send_calls_per_step']:.0f}", r["send_bytes_per_step"], r["send_bytes_stats"],
                                 r["formula_send_bytes"], f"{r['send_bytes_per_step'] / max(1, r['formula_send_bytes']):.4f}"])
    table(["schedule", "pp", "m", "rank", "mb act", "sends", "kSend bytes", "stats bytes", "formula", "ratio"], rows)
    print("   every schedule, pp and m: " + ("measured == formula on every rank" if not mismatches
                                              else "MISMATCH: " + ", ".join(mismatches)))

    # 4./5. Step times
    print("\n4. Training step (zero_grad + forward/backward + AdamW step), same model and global batch; slowest rank, "
          "median; PyTorch: torch.distributed.pipelining + FSDP2 over Gloo")
    rows = []
    dp4 = next((x["step_ms"] for x in (cmp4 or {}).get("layouts", []) if x["name"].startswith("dp")), None)
    loc = next((x["step_ms"] for x in (local or {}).get("layouts", [])), None)
    torch_by = {}
    for c in (tdp or {}).get("configs", []):
        torch_by[(c["schedule"], c["m"])] = c
    for src, procs in ((local, 1), (cmp4, 4)):
        if not src:
            continue
        for x in src["layouts"]:
            t = torch_by.get((x.get("schedule"), x.get("m"))) if x["pp"] > 1 else None
            tcol = "-" if t is None else (f"failed: {t['error']}" if "error" in t else
                                          f"{t['step_ms']:.1f} ({x['step_ms'] / t['step_ms']:.2f}){busy_mark(t.get('phase'))}")
            rows.append([x["name"], procs, f"{x['step_ms']:.1f}", f"{x['cpu_ms']:.1f}",
                         f"{x['step_ms'] / dp4:.2f}" if dp4 else "-", f"{x['step_ms'] / loc:.2f}" if loc else "-",
                         tcol, f"{src['phase']['other_processes_cores']:.2f}" + busy_mark(src["phase"])])
    table(["layout", "procs", "step ms", "cpu ms", "vs dp4", "vs local", "PyTorch ms (C++/Py)", "others' cores"], rows)
    if tdp and "error" in tdp:
        print(f"   PyTorch pp=2 x dp=2: failed: {tdp['error']}")
    print("   (the C++ layouts are stepped in turn in one run; local and PyTorch run separately, minutes apart: their "
          "ratios also carry the difference in the machine's load, each side's BUSY mark is its own)")

    print("\n5. pp=2 schedule step (PipelineSchedule::step / schedule.step() alone), C++ against PyTorch's "
          "torch.distributed.pipelining over Gloo, 2 processes")
    rows = []
    cpp_by = {(c["schedule"], c["m"]): c for c in (pp[2] or {}).get("cases", [])}
    for t in (tpp2 or {}).get("configs", []):
        c = cpp_by.get((t["schedule"], t["m"]))
        cms = slowest_step_ms(c) if c else None
        if "error" in t:
            rows.append([t["schedule"], t["m"], f"{cms:.1f}" if cms else "-", f"failed: {t['error']}", "-", ""])
        else:
            rows.append([t["schedule"], t["m"], f"{cms:.1f}" if cms else "-", f"{t['step_ms']:.1f}",
                         f"{cms / t['step_ms']:.2f}" if cms else "-",
                         f"{t['phase']['other_processes_cores']:.2f}" + busy_mark(t.get("phase"))])
    table(["schedule", "m", "C++ ms", "PyTorch ms", "C++/Py", "Py others' cores"], rows)
    if tpp2 and "error" in tpp2:
        print(f"   PyTorch pp=2: failed: {tpp2['error']}")
    if tpp2:
        print(f"   (torch {tpp2.get('torch')}; C++ ms: the slowest rank's median StepStats::step_seconds of table 1, "
              "taken minutes before the PyTorch figures; C++'s load is table 1's 'others' cores')")

    print(f"\nBUSY: other processes used more than {BUSY_CORES} cores on average during that figure's timed steps "
          "(/proc/stat busy seconds minus the ranks' own CPU seconds, over the wall time). Load average "
          f"{a.load_before} before the runs, {a.load_after} after.")
    merged = {"config": cfg, "cores": cores, "load1_before": a.load_before, "load1_after": a.load_after,
              "busy_threshold_cores": BUSY_CORES, "pipeline_pp2": pp[2], "pipeline_pp4": pp[4],
              "compare_w4": cmp4, "compare_local": local, "torch_pp2": tpp2, "torch_pp2dp2": tdp,
              "p2p_mismatches": mismatches}
    with open(a.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--world", type=int, default=2)
    r.add_argument("--pp", type=int, default=2)
    r.add_argument("--dp", type=int, default=1)
    r.add_argument("--configs", default="gpipe:4,1f1b:4")
    r.add_argument("--optimizer", action="store_true")
    r.add_argument("--out", required=True)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--vocab", type=int, default=256)
    r.add_argument("--context", type=int, default=64)
    r.add_argument("--d-model", dest="d_model", type=int, default=128)
    r.add_argument("--heads", type=int, default=4)
    r.add_argument("--layers", type=int, default=8)
    r.add_argument("--global-batch", dest="global_batch", type=int, default=8)
    r.add_argument("--seed", type=int, default=0)
    q = sub.add_parser("report")
    q.add_argument("--dir", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--load-before", default="?")
    q.add_argument("--load-after", default="?")
    args = ap.parse_args()
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
