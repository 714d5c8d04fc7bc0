#!/usr/bin/env python3
"""Merges the benchmark programs' JSON (fsdp_bench at world sizes 1 and 2, torch_bench at world
sizes 1 and 2, torch_bench --check), prints the tables, checks the targets, writes one JSON and
renders a PNG chart.

    python3 tools/bench/report.py --dir DIR --out results.json --png results.png [--checkpoint FILE]

DIR holds cpp_w1.json, cpp_w2.json, py_w1.json, py_w2.json and py_check.json (any may be missing;
what depends on it is reported as missing). --checkpoint: the summary table of
tools/checkpoint_benchmark.sh (its --out FILE, written by tools/bench/checkpoint_report.py), for the
checkpoint load targets; a missing file makes those rows say that the checkpoint phase did not run.

Definitions (every time is a median over the steps after warm-up):
  step time          zero_grad + forward + backward + AdamW step; at world size 2 the slower rank's
                     time of each step.
  concurrent-local   at world size 2, the local variant: each of the 2 processes trains its own
                     copy of the model on its own batches (the same per-rank work as fully_shard
                     at W=2 and as local training at W=1), both at once, no communication; the
                     steps interleave with fully_shard's in the same run. W=2 step / this is what
                     the library costs; this / the W=1 local step is what the machine costs.
  CPU ms             process CPU time of the step (every thread: MPI's progress thread, Gloo's),
                     less sensitive than wall time to other jobs on the machine.
  overhead/unit/step (t_sharded - t_local) / units, at world size 1, each side against its own
                     local training of the same model in the same process (steps interleaved).
  optim ms           the optimizer step alone (AdamW, lr from the flags, weight decay 0.01); the
                     variant "fully_shard, fsdp::optim::AdamW" (fsdp_bench's fsdp_flat) is the
                     fully_shard model with optim/'s AdamW instead of torch::optim's, trained in
                     the same process on the same batches (the same losses, bit for bit).
  memory (all bytes counted by a CPU allocator installed over LibTorch's, per rank, each variant
  on a fresh copy of the model, counting only allocations made since that copy began to be built;
  2 warm-up steps, then 3 measured steps of forward, backward, optimizer.step(), zero_grad()):
  step peak          the allocator's peak of live bytes over a whole training step: the peak reset
                     right before the forward, read after optimizer.step() and zero_grad() (the
                     largest over the measured steps); measured the same way for local training
                     (plain LibTorch, no fully_shard, this rank's batch) and for fully_shard.
  ZeRO-3 expectation per rank: sharded state + unsharded params + unsharded grads + activations:
    sharded state    parameters + gradients + AdamW's 2 moments of this rank's shards, from the
                     handles' layouts (shard_numel x element size; equal to the local_shard bytes).
    unsharded params max_unshards_in_flight (read from the root unit; default 2) x the largest unit's
                     padded unsharded FlatParameters (padded_numel x all-gather element size).
    unsharded grads  2 (units being reduced) x the largest unit's padded unsharded gradient
                     (padded_numel x reduce element size).
    activations      the local run's step peak - its parameters + gradients + optimizer state
                     (measured on the local run, same rank).
  vs expectation     (fully_shard step peak - expectation) / expectation.
  steady state       after optimizer.step() (before zero_grad): the live allocations behind the
                     parameters, the gradients and AdamW's state; "held between steps": all live
                     bytes after zero_grad().
  all-gather formula the peak of the unsharded FlatParameter buffers over forward+backward against:
                     the root's unsharded FlatParameters + the in-flight limit (2) x the largest
                     non-root unit's (handles that shard only: a handle that does not shard, e.g.
                     on one rank, has no separate unsharded buffer).
  comm formula       per handle that shards: padded bytes in its communication dtype x calls per
                     step (all-gather: 2 for a non-root FULL_SHARD unit, 1 for the root;
                     reduce-scatter: 1 when it requires grad); the Communicator counts that full
                     payload per call, a rank sends that x (W-1)/W. A handle that does not shard
                     (one rank) communicates nothing.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys

OVERHEAD_RATIO_TARGET = 5.0   # ours at most 1/5 of FSDP2's per unit per step (100-unit model)
STEP_TIME_TARGET = 0.05       # within 5% of local training (compute-bound model, W=1)
FLAT_OPTIM_TINY_TARGET = 0.3  # fsdp::optim::AdamW's step at most 0.3x torch::optim's (100-unit model)
FLAT_OPTIM_GPT_TARGET = 1.0   # and not slower on the GPT
MEMORY_TARGET = 0.10          # within 10% of the formula
W2_STEP_TARGET = 1.05         # GPT step at W=2 at most 1.05x the W=1 local step (where the machine allows)
W2_CONCURRENT_TARGET = 1.05   # ... and at most 1.05x the concurrent-local reference (2 local trainings at once)
TINY_W2_STEP_TARGET_MS = 30.0  # the 100-unit model's step at W=2, ms
WARM_LOAD_TARGET = 1.0        # fsdp::dcp warm load at least 1.0x Python DCP's (its faster reader)
COLD_LOAD_TARGET = 0.90       # fsdp::dcp cold load at least 90% of dd's cold read
LOSS_TOLERANCE = 1e-5         # first losses, this project vs PyTorch
BF16_STATE_BYTES = 12.0       # shards + sharded gradients + bf16 moments per parameter (float32 moments: 16)
BF16_STATE_SLACK = 0.01       # the shards' padding: at most 1% above
MUON_TARGET = 1.0             # fsdp::optim::Muon's step no slower than every rank orthogonalizing everything,
                              # and than torch.optim.Muon on the unsharded model
IN_FLIGHT_LIMIT = 2           # the all-gather check's in-flight limit (the runtime's default)
REDUCE_IN_FLIGHT = 2          # ZeRO-3 expectation: unsharded gradients of 2 units being reduced

MODEL_TITLES = {"tiny": "100 x Linear(8,8) units (overhead-bound)",
                "gpt": "GPT (compute-bound)"}


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def measured(variant, warmup):
    return {k: variant[k][warmup:] for k in ("step_s", "fb_s", "opt_s")}


def step_times(run, model, variant, key="step_s"):
    """Per measured step, the slowest rank's time (seconds; `key`: step_s or cpu_s), or None."""
    if run is None:
        return None
    per_rank = []
    for r in run["ranks"]:
        m = r["timing"].get(model)
        if not m or variant not in m["variants"]:
            return None
        if key not in m["variants"][variant]:
            return None
        per_rank.append(m["variants"][variant][key][m["warmup"]:])
    return [max(ts) for ts in zip(*per_rank)]


def phase_median(run, model, variant, key):
    m = run["ranks"][0]["timing"][model]
    return med(m["variants"][variant][key][m["warmup"]:])


def losses(run, model, variant, rank=0):
    if run is None:
        return None
    m = run["ranks"][rank]["timing"].get(model)
    if not m or variant not in m["variants"]:
        return None
    return m["variants"][variant]["losses"]


def fmt_bytes(b):
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "-"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"


def checkpoint_rows(path):
    """{(operation, W): row} from checkpoint_report.py's table, or None without the file. A row:
    GB/s, vs_disk (fraction or None), python_gbs, vs_python (or None), loaded (marked '*')."""
    if not path or not os.path.exists(path):
        return None
    rows = {}
    for line in open(path):
        m = re.match(r"^(load|save)(\([^)]*\))?\s+(\d+)\s+([0-9.]+)\s+(\S+)\s+(\S+)\s+(\S+)(.*)$", line.rstrip())
        if not m:
            continue
        vs_disk, py, vs_py = m.group(5), m.group(6), m.group(7)
        rows[(m.group(1) + (m.group(2) or ""), int(m.group(3)))] = {
            "gbs": float(m.group(4)),
            "vs_disk": float(vs_disk.rstrip("%")) / 100 if vs_disk.endswith("%") else None,
            "python_gbs": float(py) if py != "n/a" else None,
            "vs_python": float(vs_py.rstrip("x")) if vs_py != "n/a" else None,
            "loaded": line.rstrip().endswith("*")}
    return rows


def table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Formulas from the handles fsdp_bench reports

def unit_groups(handles):
    units = {}
    for h in handles:
        units.setdefault((h["unit"], h["root"]), []).append(h)
    return units


def memory_formula(handles):
    params = sum(h["shard_numel"] * h["element_size"] for h in handles)
    grads = sum(h["shard_numel"] * h["element_size"] for h in handles if h["requires_grad"])
    optim = 2 * grads
    root = 0
    largest = 0
    for (unit, is_root), hs in unit_groups(handles).items():
        b = sum(h["padded_numel"] * h["all_gather_element_size"] for h in hs
                if h.get("sharded", True))
        if is_root:
            root += b
        else:
            largest = max(largest, b)
    unsharded = root + IN_FLIGHT_LIMIT * largest
    return {"params": params, "grads": grads, "optimizer": optim, "peak_unsharded": unsharded,
            "root_unsharded": root, "largest_unit_unsharded": largest}


def zero3_expectation(handles, max_in_flight, local):
    """Per rank, from this rank's handles (the fully_shard run's) and its local run's memory."""
    shard_params = sum(h["shard_numel"] * h["element_size"] for h in handles)
    shard_grads = sum(h["shard_numel"] * h["element_size"] for h in handles if h["requires_grad"])
    shard_optim = 2 * shard_grads                       # AdamW: exp_avg, exp_avg_sq
    local_shard_bytes = sum(h.get("local_shard_bytes", 0) for h in handles)
    largest_params = largest_grads = root_params = 0
    largest_unit = None
    for (unit, is_root), hs in unit_groups(handles).items():
        p = sum(h["padded_numel"] * h["all_gather_element_size"] for h in hs)
        g = sum(h["padded_numel"] * h["reduce_element_size"] for h in hs if h["requires_grad"])
        if is_root:
            root_params = p
        if p > largest_params:
            largest_params, largest_unit = p, unit or "(root)"
        largest_grads = max(largest_grads, g)
    sharded_state = shard_params + shard_grads + shard_optim
    unsharded_params = max_in_flight * largest_params
    unsharded_grads = REDUCE_IN_FLIGHT * largest_grads
    local_state = local["params"] + local["grads"] + local["optimizer"]
    activations = local["step_peak"] - local_state
    return {"sharded_params": shard_params, "sharded_grads": shard_grads,
            "sharded_optimizer": shard_optim, "sharded_state": sharded_state,
            "local_shard_bytes": local_shard_bytes,
            "sharded_params_equal_local_shard_bytes": shard_params == local_shard_bytes,
            "max_unshards_in_flight": max_in_flight, "largest_unit": largest_unit,
            "largest_unit_unsharded_params": largest_params,
            "largest_unit_unsharded_grads": largest_grads,
            "unsharded_params": unsharded_params,
            "reduce_in_flight": REDUCE_IN_FLIGHT, "unsharded_grads": unsharded_grads,
            "local_params_grads_optimizer": local_state, "local_step_peak": local["step_peak"],
            "activations": activations,
            "total": sharded_state + unsharded_params + unsharded_grads + activations,
            "root_unsharded_params_not_in_expectation": root_params,
            "handles_not_sharded": sum(1 for h in handles if not h.get("sharded", True))}


def comm_formula(handles, world):
    ag_calls = ag_bytes = rs_calls = rs_bytes = 0
    for h in handles:
        if not h.get("sharded", True):
            continue   # a handle that does not shard (one rank): nothing to all-gather or reduce-scatter
        calls = 1 if h["root"] else 2   # FULL_SHARD: forward and backward; the root stays unsharded
        ag_calls += calls
        ag_bytes += calls * h["padded_numel"] * h["all_gather_element_size"]
        if h["requires_grad"]:
            rs_calls += 1
            rs_bytes += h["padded_numel"] * h["reduce_element_size"]
    sent = (world - 1) / world
    return {"all_gather": {"calls": ag_calls, "bytes": ag_bytes, "sent_bytes": ag_bytes * sent},
            "reduce_scatter": {"calls": rs_calls, "bytes": rs_bytes, "sent_bytes": rs_bytes * sent}}


# ---------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--png", required=True)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--muon", default=None, help="tools/muon_benchmark.sh's JSON (the Muon targets)")
    args = p.parse_args()
    d = args.dir
    cpp1, cpp2 = load(os.path.join(d, "cpp_w1.json")), load(os.path.join(d, "cpp_w2.json"))
    py1, py2 = load(os.path.join(d, "py_w1.json")), load(os.path.join(d, "py_w2.json"))
    check = load(os.path.join(d, "py_check.json"))
    models = list(cpp1["ranks"][0]["timing"]) if cpp1 else ["tiny", "gpt"]
    results = {"definitions": __doc__.split("Definitions")[1].strip(), "models": {}, "targets": []}
    text = []
    say = text.append

    if check:
        say(f"PyTorch {check['torch']} on the CPU with Gloo (world size 1):")
        for k, v in check["checks"].items():
            say(f"  {k}: {v}")
        say("")
        results["pytorch_cpu_checks"] = check

    for model in models:
        res = {"title": MODEL_TITLES.get(model, model)}
        results["models"][model] = res
        cm = cpp1["ranks"][0]["timing"][model] if cpp1 else None
        units = cm["units_with_params"] if cm else None
        res["units"] = units
        # --- world size 1: step time and overhead per unit
        rows, w1 = [], {}
        sides = [("this project: local", cpp1, "local", "cpp"),
                 ("this project: fully_shard", cpp1, "fsdp", "cpp"),
                 ("this project: fully_shard, fsdp::optim::AdamW", cpp1, "fsdp_flat", "cpp"),
                 ("PyTorch: local", py1, "local", "py"),
                 ("PyTorch: FSDP2 fully_shard", py1, "fsdp2", "py"),
                 ("PyTorch: FSDP1 FSDP(use_orig_params)", py1, "fsdp1", "py")]
        ref_loss = (losses(cpp1, model, "fsdp") or [float("nan")])[0]
        for label, run, variant, side in sides:
            ts = step_times(run, model, variant)
            if ts is None:
                continue
            t = med(ts)
            local = med(step_times(run, model, "local") or [])
            ov = (t - local) / units if variant != "local" and units else None
            first = losses(run, model, variant)[0]
            cpu = med(step_times(run, model, variant, "cpu_s") or [])
            cpu_local = med(step_times(run, model, "local", "cpu_s") or [])
            ls, ref_ls = losses(run, model, variant), losses(cpp1, model, "fsdp") or []
            common = min(len(ls), len(ref_ls))
            entry = {"step_ms": t * 1e3, "fb_ms": phase_median(run, model, variant, "fb_s") * 1e3,
                     "opt_ms": phase_median(run, model, variant, "opt_s") * 1e3,
                     "overhead_per_unit_step_us": ov * 1e6 if ov is not None else None,
                     "vs_local": t / local - 1 if variant != "local" else None,
                     "cpu_ms": cpu * 1e3,
                     "cpu_vs_local": cpu / cpu_local - 1 if variant != "local" else None,
                     "first_loss": first, "last_loss": losses(run, model, variant)[-1],
                     "first_loss_diff_vs_this_project": abs(first - ref_loss),
                     "max_loss_diff_vs_this_project": max((abs(a - b) for a, b in zip(ls, ref_ls)), default=None),
                     "common_steps": common, "steps": len(ts)}
            if variant == "fsdp1":
                entry["sharding"] = run["ranks"][0]["timing"][model]["variants"][variant]["sharding"]
            w1[f"{side}:{variant}"] = entry
            rows.append([label, f"{entry['step_ms']:.2f}", f"{entry['fb_ms']:.2f}",
                         f"{entry['opt_ms']:.2f}",
                         "-" if entry["vs_local"] is None else f"{100 * entry['vs_local']:+.1f}%",
                         f"{entry['cpu_ms']:.2f}",
                         "-" if entry["cpu_vs_local"] is None else f"{100 * entry['cpu_vs_local']:+.1f}%",
                         "-" if ov is None else f"{ov * 1e6:.1f}",
                         f"{first:.8f}", f"{entry['first_loss_diff_vs_this_project']:.1e}",
                         "-" if entry["max_loss_diff_vs_this_project"] is None
                         else f"{entry['max_loss_diff_vs_this_project']:.1e} ({common})"])
        res["world1"] = w1
        say(f"== {res['title']}: world size 1, {units} units with parameters, "
            f"medians over {cm['steps'] if cm else '?'} (C++) steps after warm-up ==")
        say(table(["variant", "step ms", "fwd+bwd ms", "optim ms", "vs local", "CPU ms", "CPU vs local",
                   "overhead us/unit/step",
                   "first loss", "|d first loss|", "max |d loss| (steps)"], rows))
        alone = (cm or {}).get("collectives_alone")
        if alone and alone["step_s"]:
            res["collectives_alone_w1"] = {"step_ms": med(alone["step_s"]) * 1e3,
                                           "cpu_ms": med(alone["cpu_s"]) * 1e3}
            say(f"  this project's collectives of one step alone (replayed, same sizes and buffers): "
                f"{res['collectives_alone_w1']['step_ms']:.2f} ms wall, "
                f"{res['collectives_alone_w1']['cpu_ms']:.2f} ms CPU")
        if "py:fsdp1" in w1:
            say(f"  (FSDP1 at world size 1 runs {w1['py:fsdp1'].get('sharding')}: it switches "
                f"FULL_SHARD to NO_SHARD on one rank)")
        say("")

        # --- world size 2: step time and losses
        rows, w2 = [], {}
        ref2 = [losses(cpp2, model, "fsdp", r) for r in (0, 1)] if cpp2 else None
        for label, run, variant, side in [("this project: local, 2 processes at once (no communication)", cpp2,
                                           "local", "cpp"),
                                          ("this project: fully_shard (mpirun -np 2)", cpp2, "fsdp", "cpp"),
                                          ("PyTorch: FSDP2 (gloo, 2 processes)", py2, "fsdp2", "py"),
                                          ("PyTorch: FSDP1 (gloo, 2 processes)", py2, "fsdp1", "py")]:
            ts = step_times(run, model, variant)
            if ts is None:
                continue
            l0, l1 = losses(run, model, variant, 0), losses(run, model, variant, 1)
            cpu2 = step_times(run, model, variant, "cpu_s")
            # Local training at W=2 (the concurrent-local reference) trains each rank's copy on its
            # own batches: its losses part from fully_shard's after the first step by design.
            compare = ref2 and variant != "local"
            entry = {"step_ms": med(ts) * 1e3, "cpu_ms_slowest_rank": med(cpu2) * 1e3 if cpu2 else None,
                     "first_loss_rank0": l0[0], "first_loss_rank1": l1[0],
                     "steps": len(ts),
                     "first_loss_diff_vs_this_project":
                         max(abs(l0[0] - ref2[0][0]), abs(l1[0] - ref2[1][0])) if compare else None,
                     "max_loss_diff_vs_this_project": max(
                         (abs(a - b) for r, lr in ((0, l0), (1, l1)) for a, b in zip(lr, ref2[r])),
                         default=None) if compare else None,
                     "common_steps": min(len(l0), len(ref2[0])) if compare else None}
            w2[f"{side}:{variant}"] = entry
            rows.append([label, f"{entry['step_ms']:.2f}",
                         "-" if entry["cpu_ms_slowest_rank"] is None else f"{entry['cpu_ms_slowest_rank']:.2f}",
                         f"{l0[0]:.8f}", f"{l1[0]:.8f}",
                         "-" if entry["first_loss_diff_vs_this_project"] is None
                         else f"{entry['first_loss_diff_vs_this_project']:.1e}",
                         "-" if entry["max_loss_diff_vs_this_project"] is None
                         else f"{entry['max_loss_diff_vs_this_project']:.1e} ({entry['common_steps']})"])
        res["world2"] = w2
        alone2 = cpp2["ranks"][0]["timing"].get(model, {}).get("collectives_alone") if cpp2 else None
        if alone2 and alone2["step_s"]:
            res["collectives_alone_w2"] = {"step_ms": med(alone2["step_s"]) * 1e3,
                                           "cpu_ms": med(alone2["cpu_s"]) * 1e3}
        say(f"== {res['title']}: world size 2 (2 processes on this machine's cores) ==")
        say(table(["variant", "step ms", "CPU ms/rank", "first loss r0", "first loss r1", "|d first loss|",
                   "max |d loss| (steps)"], rows))
        if "collectives_alone_w2" in res:
            say(f"  this project's collectives of one step alone (replayed): "
                f"{res['collectives_alone_w2']['step_ms']:.2f} ms wall, "
                f"{res['collectives_alone_w2']['cpu_ms']:.2f} ms CPU (rank 0)")
        say("")

        # --- memory per rank, counted by the allocator
        # 1. the peak of live bytes over a whole training step, local vs fully_shard, against the
        #    ZeRO-3 expectation
        res["memory_peak"] = {}
        peak_rows, peak_notes = [], []
        for world, run in ((1, cpp1), (2, cpp2)):
            if run is None or "memory" not in run["ranks"][0]:
                continue
            per_rank = []
            for r in run["ranks"]:
                m = r["memory"][model]["fsdp"]
                loc = r["memory"][model]["local"]
                if "step_peak" not in m or "step_peak" not in loc:
                    continue
                hs = m.get("handles") or r["timing"][model]["handles"]
                e = zero3_expectation(hs, m.get("max_unshards_in_flight") or IN_FLIGHT_LIMIT, loc)
                diff = m["step_peak"] - e["total"]
                entry = {
                    "rank": r["rank"],
                    "local_step_peak": loc["step_peak"],
                    "fully_shard_step_peak": m["step_peak"],
                    "ratio_fully_shard_over_local": m["step_peak"] / loc["step_peak"],
                    "expectation": e,
                    "expected_total": e["total"],
                    "measured_minus_expected": diff,
                    "measured_vs_expected": diff / e["total"],
                    "phases": {v: {"forward_peak": x.get("forward_peak"),
                                   "forward_backward_peak": x["forward_backward_peak"],
                                   "step_peak": x["step_peak"], "step_peaks": x["step_peaks"],
                                   "step_start": x["step_start"],
                                   "at_peak_held_from_before_step": x.get("step_peak_held_from_before_step"),
                                   "at_peak_allocated_during_step": x.get("step_peak_allocated_during_step")}
                               for v, x in (("local", loc), ("fully_shard", m))},
                    "unsharded_params_at_fully_shard_peak": m.get("unsharded_at_step_peak"),
                    "steady_state": {v: {"params": x["params"], "grads": x["grads"],
                                         "optimizer": x["optimizer"],
                                         "all_after_optimizer_step": x["persistent_total"],
                                         "held_between_steps": x["after_zero_grad_total"]}
                                     for v, x in (("local", loc), ("fully_shard", m))},
                    "allocator": {v: {"older_live_bytes_at_start": x.get("older_live_bytes_at_start"),
                                      "absolute_step_peak": x.get("allocator_absolute_step_peak")}
                                  for v, x in (("local", loc), ("fully_shard", m))},
                }
                per_rank.append(entry)
                peak_rows.append([f"W={world}", f"{r['rank']}", fmt_bytes(loc["step_peak"]),
                                  fmt_bytes(m["step_peak"]), f"{entry['ratio_fully_shard_over_local']:.3f}",
                                  fmt_bytes(e["total"]), fmt_bytes(e["sharded_state"]),
                                  fmt_bytes(e["unsharded_params"]), fmt_bytes(e["unsharded_grads"]),
                                  fmt_bytes(e["activations"]),
                                  f"{'+' if diff >= 0 else '-'}{fmt_bytes(abs(diff))} "
                                  f"({100 * entry['measured_vs_expected']:+.1f}%)"])
            if not per_rank:
                continue
            res["memory_peak"][f"W{world}"] = per_rank
            pr = per_rank[0]
            e = pr["expectation"]
            ph = pr["phases"]
            peak_notes.append(
                f"  W={world} terms (rank {pr['rank']}): sharded state = params {fmt_bytes(e['sharded_params'])} + grads "
                f"{fmt_bytes(e['sharded_grads'])} + AdamW moments {fmt_bytes(e['sharded_optimizer'])} (handles' "
                f"layouts; = local_shard bytes: {'yes' if e['sharded_params_equal_local_shard_bytes'] else 'NO'}); "
                f"unsharded params = {e['max_unshards_in_flight']} (max_unshards_in_flight) x "
                f"{fmt_bytes(e['largest_unit_unsharded_params'])} (largest unit '{e['largest_unit']}'); "
                f"unsharded grads = {e['reduce_in_flight']} x {fmt_bytes(e['largest_unit_unsharded_grads'])}; "
                f"activations = local peak {fmt_bytes(e['local_step_peak'])} - local params+grads+optimizer "
                f"{fmt_bytes(e['local_params_grads_optimizer'])}")
            fs, lo = ph["fully_shard"], ph["local"]
            peak_notes.append(
                f"  W={world} phases (rank {pr['rank']}; fully_shard / local): peak through forward "
                f"{fmt_bytes(fs['forward_peak'])} / {fmt_bytes(lo['forward_peak'])}, through backward "
                f"{fmt_bytes(fs['forward_backward_peak'])} / {fmt_bytes(lo['forward_backward_peak'])}, whole step "
                f"{fmt_bytes(fs['step_peak'])} / {fmt_bytes(lo['step_peak'])}; at the peak, held from before the "
                f"step {fmt_bytes(fs['at_peak_held_from_before_step'])} / {fmt_bytes(lo['at_peak_held_from_before_step'])}"
                f" and allocated during it {fmt_bytes(fs['at_peak_allocated_during_step'])} / "
                f"{fmt_bytes(lo['at_peak_allocated_during_step'])}, of which unsharded parameter buffers "
                f"{fmt_bytes(pr['unsharded_params_at_fully_shard_peak'])} (the root unit's, not in the "
                f"expectation: {fmt_bytes(e['root_unsharded_params_not_in_expectation'])})")
            ss = pr["steady_state"]
            peak_notes.append(
                f"  W={world} steady state (rank {pr['rank']}; fully_shard / local): after optimizer.step() "
                f"params {fmt_bytes(ss['fully_shard']['params'])} / {fmt_bytes(ss['local']['params'])}, grads "
                f"{fmt_bytes(ss['fully_shard']['grads'])} / {fmt_bytes(ss['local']['grads'])}, optimizer state "
                f"{fmt_bytes(ss['fully_shard']['optimizer'])} / {fmt_bytes(ss['local']['optimizer'])}, all live "
                f"{fmt_bytes(ss['fully_shard']['all_after_optimizer_step'])} / "
                f"{fmt_bytes(ss['local']['all_after_optimizer_step'])}; held between steps (after zero_grad) "
                f"{fmt_bytes(ss['fully_shard']['held_between_steps'])} / {fmt_bytes(ss['local']['held_between_steps'])}")
            if e["handles_not_sharded"]:
                peak_notes.append(
                    f"  W={world}: {e['handles_not_sharded']} of {len(m.get('handles') or [])} handles do not "
                    f"shard (each is its own shard: no unsharded copy, no separate gradient buffer), so the "
                    f"unsharded terms are an upper bound there")
        if peak_rows:
            say(f"== {res['title']}: peak memory per rank over a whole training step (forward, backward, "
                f"optimizer.step(), zero_grad(); counting CPU allocator) vs the ZeRO-3 expectation ==")
            say(table(["world", "rank", "local peak", "fully_shard peak", "fs/local", "ZeRO-3 expected",
                       "= sharded state", "+ unsharded params", "+ unsharded grads", "+ activations",
                       "measured - expected"], peak_rows))
            for line in peak_notes:
                say(line)
            say("")

        # 2. steady state after the step, and the all-gather buffers against their formula
        res["memory"] = {}
        for world, run in ((1, cpp1), (2, cpp2)):
            if run is None or "memory" not in run["ranks"][0]:
                continue
            rows = []
            per_rank = []
            for r in run["ranks"]:
                m = r["memory"][model]["fsdp"]
                loc = r["memory"][model]["local"]
                hs = m.get("handles") or r["timing"][model]["handles"]
                f = memory_formula(hs)
                comp = {}
                for key in ("params", "grads", "optimizer", "peak_unsharded"):
                    comp[key] = {"measured": m[key], "formula": f[key], "local": loc[key]}
                comp["total"] = {"measured": sum(m[k] for k in ("params", "grads", "optimizer", "peak_unsharded")),
                                 "formula": sum(f[k] for k in ("params", "grads", "optimizer", "peak_unsharded")),
                                 "local": sum(loc[k] for k in ("params", "grads", "optimizer"))}
                for v in comp.values():
                    v["ratio"] = v["measured"] / v["formula"] if v["formula"] else (1.0 if v["measured"] == 0 else float("inf"))
                per_rank.append({"rank": r["rank"], "components": comp,
                                 "peak_forward_backward_transient": m["peak_forward_backward_transient"],
                                 "local_peak_forward_backward_transient": loc["peak_forward_backward_transient"],
                                 "held_between_steps": m.get("after_zero_grad_total"),
                                 "local_held_between_steps": loc.get("after_zero_grad_total"),
                                 "root_unsharded_formula": f["root_unsharded"],
                                 "largest_unit_unsharded_formula": f["largest_unit_unsharded"]})
            res["memory"][f"W{world}"] = per_rank
            labels = {"peak_unsharded": "all-gather buffers (peak)",
                      "total": "state + all-gather peak"}
            for pr in per_rank:
                for key in ("params", "grads", "optimizer", "peak_unsharded", "total"):
                    c = pr["components"][key]
                    rows.append([f"rank {pr['rank']}", labels.get(key, key), fmt_bytes(c["measured"]),
                                 fmt_bytes(c["formula"]), f"{100 * (c['ratio'] - 1):+.1f}%", fmt_bytes(c["local"])])
                if pr["held_between_steps"] is not None:
                    rows.append([f"rank {pr['rank']}", "held between steps", fmt_bytes(pr["held_between_steps"]),
                                 "-", "-", fmt_bytes(pr["local_held_between_steps"])])
            say(f"== {res['title']}: steady state per rank after optimizer.step(), world size {world} "
                f"(counting CPU allocator; formula: shard bytes, 2 AdamW moments; all-gather buffers: root "
                f"{fmt_bytes(per_rank[0]['root_unsharded_formula'])} + {IN_FLIGHT_LIMIT} x largest unit "
                f"{fmt_bytes(per_rank[0]['largest_unit_unsharded_formula'])} unsharded) ==")
            say(table(["rank", "state", "fully_shard", "formula", "vs formula", "local training"], rows))
            say(f"  peak of forward+backward on top of the bytes held before the forward (rank 0): fully_shard "
                f"{fmt_bytes(per_rank[0]['peak_forward_backward_transient'])}, local "
                f"{fmt_bytes(per_rank[0]['local_peak_forward_backward_transient'])}")
            say("")

        # --- communication per step
        res["comm"] = {}
        rows = []
        for world, run in ((1, cpp1), (2, cpp2)):
            if run is None:
                continue
            r0 = run["ranks"][0]["timing"][model]
            f = comm_formula(r0["handles"], world)
            entry = {}
            for kind in ("all_gather", "reduce_scatter"):
                got = r0["comm_per_step"][kind]
                sent = got["bytes"] * (world - 1) / world
                equal = got["calls"] == f[kind]["calls"] and got["bytes"] == f[kind]["bytes"]
                entry[kind] = {"measured_calls": got["calls"], "measured_bytes": got["bytes"],
                               "measured_sent_bytes": sent, "formula_calls": f[kind]["calls"],
                               "formula_bytes": f[kind]["bytes"], "formula_sent_bytes": f[kind]["sent_bytes"],
                               "equal": equal}
                rows.append([f"W={world}", kind, f"{got['calls']:g}", f"{f[kind]['calls']}",
                             f"{got['bytes']:.0f}", f"{f[kind]['bytes']}", f"{sent:.0f}",
                             f"{f[kind]['sent_bytes']:.0f}", "yes" if equal else "NO"])
            others = {k: v for k, v in r0["comm_per_step"].items()
                      if k not in ("all_gather", "reduce_scatter") and v["calls"]}
            entry["other_collectives_per_step"] = others
            res["comm"][f"W{world}"] = entry
        say(f"== {res['title']}: collectives per step (rank 0; payload as the Communicator counts it, "
            f"sent = payload x (W-1)/W) ==")
        say(table(["world", "collective", "calls", "formula", "payload B", "formula B", "sent B",
                   "formula sent B", "equal"], rows))
        say("")

    # --- headline figures of this run, one line each (easy to grep: "W=1 overhead", "W=1 GPT step time")
    headline = results["headline"] = {}
    say("== headline ==")
    tiny1 = results["models"].get("tiny", {}).get("world1", {})
    if "cpp:fsdp" in tiny1 and tiny1["cpp:fsdp"]["overhead_per_unit_step_us"] is not None:
        ov = tiny1["cpp:fsdp"]["overhead_per_unit_step_us"]
        headline["w1_overhead_us_per_unit_step"] = ov
        others = [f"{name} {tiny1[k]['overhead_per_unit_step_us']:.1f} us"
                  for k, name in (("py:fsdp2", "PyTorch FSDP2"), ("py:fsdp1", "PyTorch FSDP1"))
                  if k in tiny1 and tiny1[k]["overhead_per_unit_step_us"] is not None]
        say(f"W=1 overhead per unit per step (tiny, {results['models']['tiny']['units']} units): "
            f"{ov:.1f} us/unit/step for fully_shard (step {tiny1['cpp:fsdp']['step_ms']:.2f} ms vs local "
            f"{tiny1['cpp:local']['step_ms']:.2f} ms)" + (f"; {', '.join(others)}" if others else ""))
    gpt1 = results["models"].get("gpt", {}).get("world1", {})
    if "cpp:fsdp" in gpt1 and "cpp:local" in gpt1:
        ratio = gpt1["cpp:fsdp"]["step_ms"] / gpt1["cpp:local"]["step_ms"]
        cpu_ratio = gpt1["cpp:fsdp"]["cpu_ms"] / gpt1["cpp:local"]["cpu_ms"]
        headline["w1_gpt_step_time_ratio_fully_shard_over_local"] = ratio
        headline["w1_gpt_cpu_time_ratio_fully_shard_over_local"] = cpu_ratio
        say(f"W=1 GPT step time fully_shard/local: {ratio:.3f} ({gpt1['cpp:fsdp']['step_ms']:.2f} ms / "
            f"{gpt1['cpp:local']['step_ms']:.2f} ms; process CPU time {cpu_ratio:.3f})")
    for model, res in results["models"].items():
        for w, per_rank in res.get("memory_peak", {}).items():
            worst = max(per_rank, key=lambda pr: pr["fully_shard_step_peak"])
            headline[f"{model}_{w}_peak"] = {k: worst[k] for k in (
                "rank", "local_step_peak", "fully_shard_step_peak", "ratio_fully_shard_over_local",
                "expected_total", "measured_minus_expected", "measured_vs_expected")}
            say(f"{w.replace('W', 'W=')} {model} step peak (rank {worst['rank']}): fully_shard "
                f"{fmt_bytes(worst['fully_shard_step_peak'])}, local {fmt_bytes(worst['local_step_peak'])} "
                f"(fully_shard/local {worst['ratio_fully_shard_over_local']:.3f}), ZeRO-3 expectation "
                f"{fmt_bytes(worst['expected_total'])} ({100 * worst['measured_vs_expected']:+.1f}%)")
    say("")

    # --- targets
    targets = results["targets"]

    def target(name, met, measured_text, detail=None):
        targets.append({"target": name, "met": met, "measured": measured_text, "detail": detail})

    tiny = results["models"].get("tiny", {}).get("world1", {})
    if "cpp:fsdp" in tiny and "py:fsdp2" in tiny:
        ours = tiny["cpp:fsdp"]["overhead_per_unit_step_us"]
        theirs = tiny["py:fsdp2"]["overhead_per_unit_step_us"]
        target("overhead per unit per step <= 1/5 of FSDP2's (100-unit model, W=1)",
               ours <= theirs / OVERHEAD_RATIO_TARGET,
               f"{ours:.1f} us vs FSDP2 {theirs:.1f} us (1/{theirs / ours:.1f})" if ours > 0 else
               f"{ours:.1f} us vs FSDP2 {theirs:.1f} us")
    gpt = results["models"].get("gpt", {}).get("world1", {})
    if "cpp:fsdp" in gpt:
        v = gpt["cpp:fsdp"]["vs_local"]
        target("step time within 5% of local training (compute-bound GPT, W=1)",
               v <= STEP_TIME_TARGET,
               f"{100 * v:+.1f}% ({gpt['cpp:fsdp']['step_ms']:.1f} ms vs {gpt['cpp:local']['step_ms']:.1f} ms; "
               f"process CPU time {100 * gpt['cpp:fsdp']['cpu_vs_local']:+.1f}%)")
    gpt2 = results["models"].get("gpt", {}).get("world2", {}).get("cpp:fsdp")
    concurrent = results["models"].get("gpt", {}).get("world2", {}).get("cpp:local")
    if gpt2 and concurrent:
        # What the library costs: the same per-rank work, two processes at once, with and without
        # fully_shard's communication.
        ratio = gpt2["step_ms"] / concurrent["step_ms"]
        cpu2, cpu_c = gpt2.get("cpu_ms_slowest_rank"), concurrent.get("cpu_ms_slowest_rank")
        cpu_text = (f"; CPU {cpu2:.1f} vs {cpu_c:.1f} ms/rank, {cpu2 / cpu_c:.2f}x" if cpu2 and cpu_c else "")
        target(f"GPT step at W=2 within {W2_CONCURRENT_TARGET:.2f}x of the concurrent-local reference "
               "(fully_shard, 2 processes, vs 2 local trainings of the same per-rank work at once, "
               "no communication; the slower rank's step each)",
               ratio <= W2_CONCURRENT_TARGET,
               f"{ratio:.2f}x ({gpt2['step_ms']:.1f} ms vs {concurrent['step_ms']:.1f} ms{cpu_text})")
    if gpt2 and "cpp:local" in gpt:
        local = gpt["cpp:local"]
        ratio = gpt2["step_ms"] / local["step_ms"]
        cpu2 = gpt2.get("cpu_ms_slowest_rank")
        cpu_text = (f"; CPU {cpu2:.1f} ms/rank vs {local['cpu_ms']:.1f} ms, {cpu2 / local['cpu_ms']:.2f}x"
                    if cpu2 else "")
        # What the machine costs: two processes on its cores, each computing slower than one alone.
        machine = (f"; the machine: concurrent-local {concurrent['step_ms']:.1f} ms = "
                   f"{concurrent['step_ms'] / local['step_ms']:.2f}x W=1 local" if concurrent else "")
        target(f"GPT step at W=2 within {W2_STEP_TARGET:.2f}x of the W=1 local step where the machine allows "
               "(fully_shard, 2 processes, slower rank's step vs local training in one process)",
               ratio <= W2_STEP_TARGET,
               f"{ratio:.2f}x ({gpt2['step_ms']:.1f} ms vs {local['step_ms']:.1f} ms{cpu_text}{machine})")
    tiny2 = results["models"].get("tiny", {}).get("world2", {}).get("cpp:fsdp")
    if tiny2:
        tiny_c = results["models"].get("tiny", {}).get("world2", {}).get("cpp:local")
        target(f"100-unit model's step at W=2 <= {TINY_W2_STEP_TARGET_MS:.0f} ms (fully_shard, 2 processes, the "
               "slower rank's step)",
               tiny2["step_ms"] <= TINY_W2_STEP_TARGET_MS,
               f"{tiny2['step_ms']:.1f} ms (CPU {tiny2['cpu_ms_slowest_rank']:.1f} ms/rank"
               + (f"; concurrent-local {tiny_c['step_ms']:.1f} ms" if tiny_c else "") + ")")
    ckpt = checkpoint_rows(args.checkpoint)
    warm_name = (f"warm dcp load >= {WARM_LOAD_TARGET:.1f}x Python DCP at W=1 / W=2 (fsdp::dcp load, page cache "
                 "warm, vs Python DCP's faster reader; tools/checkpoint_benchmark.sh)")
    cold_name = (f"cold dcp load >= {100 * COLD_LOAD_TARGET:.0f}% of dd at W=1 / W=2 (fsdp::dcp load, page cache "
                 "dropped, vs dd's cold read of the same folder; tools/checkpoint_benchmark.sh)")
    if ckpt is None:
        why = "not measured: the checkpoint phase did not run (no tools/checkpoint_benchmark.sh summary)"
        target(warm_name, None, why)
        target(cold_name, None, why)
    else:
        results["checkpoint"] = {f"{op} W={w}": r for (op, w), r in ckpt.items()}
        for name, op, key, limit, fmt in (
                (warm_name, "load(page cache warm)", "vs_python", WARM_LOAD_TARGET,
                 lambda r: f"{r['vs_python']:.2f}x ({r['gbs']:.2f} vs {r['python_gbs']:.2f} GB/s)"),
                (cold_name, "load(cold)", "vs_disk", COLD_LOAD_TARGET,
                 lambda r: f"{100 * r['vs_disk']:.0f}% ({r['gbs']:.2f} GB/s)")):
            parts, verdicts = [], []
            for w in (1, 2):
                r = ckpt.get((op, w))
                if r is None or r[key] is None:
                    parts.append(f"W={w} not measured")
                    verdicts.append(None)
                    continue
                part = f"W={w} {fmt(r)}" + (" [load average > 2.5]" if r["loaded"] else "")
                off = ckpt.get((op[:-1] + ", checksums off)", w)) if op.endswith("warm)") else None
                if off is not None and off["vs_python"] is not None:
                    # The same load without verify-before-write, in the same run: what the checksums cost.
                    part += f", checksums off {off['vs_python']:.2f}x"
                parts.append(part)
                verdicts.append(r[key] >= limit)
            # MISSED if either world size misses; NOT RUN if one was not measured and none missed.
            target(name, False if False in verdicts else None if None in verdicts else True, "; ".join(parts))
    flat_rows = []
    for model, limit in (("tiny", FLAT_OPTIM_TINY_TARGET), ("gpt", FLAT_OPTIM_GPT_TARGET)):
        w1 = results["models"].get(model, {}).get("world1", {})
        if "cpp:fsdp_flat" in w1 and "cpp:fsdp" in w1:
            flat, ref = w1["cpp:fsdp_flat"]["opt_ms"], w1["cpp:fsdp"]["opt_ms"]
            flat_rows.append((model, flat, ref, flat <= limit * ref, limit))
    if flat_rows:
        target("optimizer time <= 0.3x torch::optim's on the 100-unit model and not slower on the GPT "
               "(fsdp::optim::AdamW vs torch::optim::AdamW, fully_shard, W=1)",
               all(r[3] for r in flat_rows),
               "; ".join(f"{m}: {f:.3f} ms vs {r:.3f} ms ({f / r:.2f}x, target <= {lim}x)"
                         for m, f, r, _, lim in flat_rows))
    for model, res in results["models"].items():
        for w, per_rank in res.get("memory", {}).items():
            worst = max(per_rank, key=lambda pr: max(abs(c["ratio"] - 1) for c in pr["components"].values()))
            dev = {k: c["ratio"] - 1 for k, c in worst["components"].items()}
            key = max(dev, key=lambda k: abs(dev[k]))
            target(f"steady-state memory and all-gather buffers within 10% of the formula ({model}, {w})",
                   all(abs(x) <= MEMORY_TARGET for x in dev.values()),
                   f"total {100 * dev['total']:+.1f}%, worst component {key} {100 * dev[key]:+.1f}% "
                   f"(rank {worst['rank']})")
        for w, entry in res.get("comm", {}).items():
            ok = entry["all_gather"]["equal"] and entry["reduce_scatter"]["equal"]
            target(f"communication bytes equal the formula ({model}, {w})", ok,
                   f"all-gather {entry['all_gather']['measured_bytes']:.0f} B / "
                   f"{entry['all_gather']['formula_bytes']} B, reduce-scatter "
                   f"{entry['reduce_scatter']['measured_bytes']:.0f} B / {entry['reduce_scatter']['formula_bytes']} B")
    # bf16 moments (fsdp_bench's optimizer_states): the allocator's count of the first step's state
    # against 2 x 2 bytes per element, and shards + gradients + state per parameter over the ranks.
    for model in ("gpt", "tiny"):
        parts, ok = [], []
        for world, run in ((1, cpp1), (2, cpp2)):
            if run is None or "optimizer_states" not in run["ranks"][0]:
                continue
            per = {}
            for kind in ("float32", "bf16"):
                rs = [r["optimizer_states"][model][kind] for r in run["ranks"]]
                per[kind] = (all(r["state_bytes"] == r["formula_bytes"] for r in rs),
                             rs[0]["held_bytes_over_ranks"] / rs[0]["elements_over_ranks"])
            ok.append(per["bf16"][0] and per["float32"][0] and
                      BF16_STATE_BYTES <= per["bf16"][1] <= BF16_STATE_BYTES * (1 + BF16_STATE_SLACK))
            parts.append(f"W={world}: {per['bf16'][1]:.3f} B/param with bf16 moments, {per['float32'][1]:.3f} with "
                         f"float32; state = formula on every rank: {'yes' if per['bf16'][0] and per['float32'][0] else 'NO'}")
        if parts:
            results.setdefault("optimizer_states", {})[model] = parts
            target(f"bf16 optimizer states: shards + gradients + moments 12 bytes per parameter (16 with float32), the "
                   f"state's bytes by the allocator equal the formula ({model}, fsdp::optim::AdamW, W=1 / W=2)",
                   all(ok), "; ".join(parts))
    if args.muon:
        if os.path.exists(args.muon):
            mu = json.load(open(args.muon))
            results["muon"] = {k: v for k, v in mu.items() if k != "cpp"}
            shape = f"W={mu['world']}, {6 * mu['layers']} matrices, d_model {mu['d_model']}"
            target(f"Muon step no slower than every rank orthogonalizing every matrix (fsdp::optim::Muon, {shape})",
                   mu["owners_over_every_rank"] <= MUON_TARGET,
                   f"{mu['owners_over_every_rank']:.2f}x ({mu['owners_ms']:.1f} vs {mu['every_rank_ms']:.1f} ms)")
            target(f"Muon step no slower than torch.optim.Muon on the unsharded model ({shape}; torch in one process)",
                   mu["owners_over_torch"] <= MUON_TARGET,
                   f"{mu['owners_over_torch']:.2f}x ({mu['owners_ms']:.1f} vs {mu['torch_unsharded_ms']:.1f} ms)")
        else:
            for name in ("Muon step no slower than every rank orthogonalizing every matrix",
                         "Muon step no slower than torch.optim.Muon on the unsharded model"):
                target(name, None, "not measured: tools/muon_benchmark.sh did not run")
    diffs = []
    for model, res in results["models"].items():
        for k, e in res.get("world1", {}).items():
            diffs.append((e["first_loss_diff_vs_this_project"], f"{model} W=1 {k}"))
        for k, e in res.get("world2", {}).items():
            if e["first_loss_diff_vs_this_project"] is not None:
                diffs.append((e["first_loss_diff_vs_this_project"], f"{model} W=2 {k}"))
    if diffs:
        worst = max(diffs)
        target("first losses agree to 1e-5 (this project vs PyTorch, same weights and data)",
               worst[0] <= LOSS_TOLERANCE, f"largest difference {worst[0]:.1e} ({worst[1]})")

    say("== targets ==")
    say(table(["", "target", "measured"],
              [["NOT RUN" if t["met"] is None else "MET" if t["met"] else "MISSED", t["target"], t["measured"]]
               for t in targets]))

    print("\n".join(text))
    results["report_text"] = "\n".join(text)
    results["raw"] = {"cpp_w1": cpp1, "cpp_w2": cpp2, "py_w1": py1, "py_w2": py2}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    render(results, args.png)
    print(f"\nJSON: {args.out}\nPNG:  {args.png}")
    return 0


def render(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    colors = {"this project": "#1f77b4", "FSDP2": "#d62728", "FSDP1": "#ff7f0e", "local": "#7f7f7f",
              "PyTorch local": "#bcbd22"}

    def bars(ax, labels, values, title, ylabel, log=False, cols=None):
        xs = range(len(labels))
        ax.bar(xs, values, color=cols or [colors.get(l.split("\n")[0], "#1f77b4") for l in labels])
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        for x, v in zip(xs, values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)

    models = results["models"]
    # 1: overhead per unit per step, W=1
    ax = axes[0][0]
    labels, values = [], []
    for model in models:
        w1 = models[model].get("world1", {})
        for k, name in (("cpp:fsdp", "this project"), ("py:fsdp2", "FSDP2"), ("py:fsdp1", "FSDP1")):
            if k in w1 and w1[k]["overhead_per_unit_step_us"] is not None:
                labels.append(f"{name}\n{model}")
                values.append(max(w1[k]["overhead_per_unit_step_us"], 1e-3))
    bars(ax, labels, values, "Overhead per unit per step, W=1 (us, log)", "us", log=True)
    # 2, 3: step times W=1 and W=2
    for ax, world in ((axes[0][1], "world1"), (axes[0][2], "world2")):
        labels, values = [], []
        for model in models:
            for k, name in (("cpp:local", "local"), ("cpp:fsdp", "this project"), ("py:local", "PyTorch local"),
                            ("py:fsdp2", "FSDP2"), ("py:fsdp1", "FSDP1")):
                e = models[model].get(world, {}).get(k)
                if e:
                    labels.append(f"{name}\n{model}")
                    values.append(e["step_ms"])
        bars(ax, labels, values, f"Step time, {'W=1' if world == 'world1' else 'W=2'} (ms, log)", "ms", log=True)
        for lab in ax.get_xticklabels():
            lab.set_rotation(45)
    # 4: whole-step memory peak per rank (rank 0): local, fully_shard, ZeRO-3 expectation
    ax = axes[1][0]
    labels, loc, fs, exp = [], [], [], []
    for model in models:
        for w, per_rank in models[model].get("memory_peak", {}).items():
            pr = per_rank[0]
            labels.append(f"{model} {w}")
            loc.append(pr["local_step_peak"] / 2**20)
            fs.append(pr["fully_shard_step_peak"] / 2**20)
            exp.append(pr["expected_total"] / 2**20)
    xs = list(range(len(labels)))
    ax.bar([x - 0.27 for x in xs], loc, 0.27, label="local peak", color=colors["local"])
    ax.bar(xs, fs, 0.27, label="fully_shard peak", color=colors["this project"])
    ax.bar([x + 0.27 for x in xs], exp, 0.27, label="ZeRO-3 expectation", color="#2ca02c")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_title("Peak memory over a training step, rank 0 (MiB, log)", fontsize=10)
    ax.legend(fontsize=8)
    # 5: comm vs formula
    ax = axes[1][1]
    labels, meas, form = [], [], []
    for model in models:
        for w, e in models[model].get("comm", {}).items():
            for kind in ("all_gather", "reduce_scatter"):
                labels.append(f"{model} {w}\n{kind.replace('_', '-')}")
                meas.append(e[kind]["measured_bytes"])
                form.append(e[kind]["formula_bytes"])
    xs = list(range(len(labels)))
    ax.bar([x - 0.2 for x in xs], meas, 0.4, label="Communicator")
    ax.bar([x + 0.2 for x in xs], form, 0.4, label="formula")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=7, rotation=90)
    ax.set_yscale("log")
    ax.set_title("Payload per step (bytes, log)", fontsize=10)
    ax.legend(fontsize=8)
    # 6: GPT loss curves at W=1
    ax = axes[1][2]
    raw = results["raw"]
    for run_key, variant, name in (("cpp_w1", "local", "this project local"), ("cpp_w1", "fsdp", "this project fully_shard"),
                                   ("py_w1", "fsdp2", "FSDP2"), ("py_w1", "fsdp1", "FSDP1"),
                                   ("cpp_w2", "fsdp", "this project W=2 rank 0"), ("py_w2", "fsdp2", "FSDP2 W=2 rank 0")):
        run = raw.get(run_key)
        ls = losses(run, "gpt", variant) if run else None
        if ls:
            ax.plot(range(len(ls)), ls, label=name, linestyle="--" if "W=2" in name else "-")
    ax.set_title("GPT loss per step (same weights and data)", fontsize=10)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    met = sum(bool(t["met"]) for t in results["targets"])
    fig.suptitle(f"fully_shard (LibTorch) vs local training vs PyTorch FSDP2/FSDP1, CPU, "
                 f"1 thread per rank: {met}/{len(results['targets'])} targets met", fontsize=12)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
