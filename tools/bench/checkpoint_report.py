"""Summarises tools/checkpoint_benchmark.sh's measurement lines into one table.

usage: checkpoint_report.py RESULTS.txt
Each line: "<tool> <operation> [W=<n>] key=value ..." with GB/s=<x>; tools: disk (dd), fsdp_dcp
(this project), python_dcp (torch.distributed.checkpoint: writer/reader "fs" = FileSystemWriter,
"hf" = HuggingFaceStorageWriter). Medians over the repeats. Ratios: this project's save against the
disk's fdatasync'd write, its loads against dd's read in the same cache state, and against Python
DCP's same operation at the same world size (its faster writer). Lines "load <group> [W=<n>]
before=<x> after=<y>" give the 1-minute load average around each group; a group where it exceeded
LOADED (the benchmark's own busy processes are at most 2) is marked in the table and listed.
"""
import re
import statistics
import sys
from collections import defaultdict

LOADED = 2.5


def load_averages(path):
    """{(tool, W): (before, after)} from the "load ..." lines."""
    out = {}
    for line in open(path):
        parts = line.split()
        if len(parts) < 3 or parts[0] != "load" or "before=" not in line:
            continue
        fields = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
        out[(parts[1], fields.get("W", ""))] = (float(fields["before"]), float(fields["after"]))
    return out


def parse(path):
    rates = defaultdict(list)
    extra = defaultdict(list)
    for line in open(path):
        parts = line.split()
        if len(parts) < 2 or "GB/s=" not in line:
            continue
        tool = parts[0]
        fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        op = " ".join(p for p in parts[1:] if "=" not in p)
        key = (tool, op, fields.get("W", ""))
        rates[key].append(float(fields["GB/s"]))
        if "peak_extra_bytes" in fields:
            extra[key].append((int(fields["peak_extra_bytes"]), int(fields.get("rss_extra_bytes", -1)),
                               int(fields.get("largest_entry_bytes", 0))))
    return {k: statistics.median(v) for k, v in rates.items()}, extra


def main():
    rates, extra = parse(sys.argv[1])
    loads = load_averages(sys.argv[1])
    loaded = {k for k, v in loads.items() if max(v) > LOADED}
    disk = {op: r for (tool, op, _), r in rates.items() if tool == "disk"}
    print("disk (dd, same folder): " + ", ".join(f"{op} {r:.3f} GB/s" for op, r in sorted(disk.items())))
    print()
    print(f"{'fsdp::dcp':28} {'W':>2} {'GB/s':>7} {'vs disk':>8} {'Python DCP GB/s':>16} {'vs Python':>10} "
          f"{'alloc extra MiB':>15} {'RSS extra MiB':>14} {'largest entry MiB':>18}")
    for (tool, op, w), r in sorted(rates.items()):
        if tool != "fsdp_dcp":
            continue
        if op.startswith("save"):
            d = disk.get("write(dd,fdatasync)")
            py_ops = ["save fs", "save hf"]
        elif "cold" in op:
            d = disk.get("read(dd, cold)")
            py_ops = ["load(cold) fs", "load(cold) hf"]
        else:
            d = disk.get("read(dd, page cache warm)")
            py_ops = ["load fs", "load hf", "load(page cache warm) fs", "load(page cache warm) hf"]
        py = [rates[("python_dcp", o, w)] for o in py_ops if ("python_dcp", o, w) in rates]
        best_py = max(py) if py else None
        ex = extra.get((tool, op, w))
        peak = max(e[0] for e in ex) / 2**20 if ex else float("nan")
        rss = max(e[1] for e in ex) / 2**20 if ex and min(e[1] for e in ex) >= 0 else float("nan")
        largest = ex[0][2] / 2**20 if ex else float("nan")
        vs_disk = f"{r / d:7.0%}" if d else "    n/a"
        py_s = f"{best_py:16.3f}" if best_py else f"{'n/a':>16}"
        vs_py = f"{r / best_py:9.2f}x" if best_py else f"{'n/a':>10}"
        mark = "*" if (tool, w) in loaded or ("python_dcp", w) in loaded or ("disk", "") in loaded else ""
        print(f"{op:28} {w:>2} {r:7.3f} {vs_disk:>8} {py_s} {vs_py} {peak:15.1f} {rss:14.1f} {largest:18.1f} {mark}".rstrip())
    print()
    if loads:
        print("1-minute load average before/after each group: " +
              "; ".join(f"{t}{' W=' + w if w else ''} {b:.2f}/{a:.2f}" for (t, w), (b, a) in loads.items()))
        if loaded:
            print(f"* measured while the load average exceeded {LOADED} (other work shared the CPUs; the "
                  "figures understate the machine)")
        print()
    blocking = [l for l in open(sys.argv[1]) if "save_async(blocking part)" in l]
    if blocking:
        parts = []
        for line in blocking:
            w = re.search(r"W=(\d+)", line).group(1)
            seconds = float(re.search(r"seconds=([0-9.]+)", line).group(1))
            parts.append(f"W={w} {seconds:.3f} s")
        print("save_async, time the call blocks training (the host copy): " + "; ".join(parts))
    print()
    print("Python DCP:")
    for (tool, op, w), r in sorted(rates.items()):
        if tool == "python_dcp":
            print(f"  {op:28} W={w} {r:.3f} GB/s")


if __name__ == "__main__":
    main()
