"""tools/profile_w2.sh's report: the CPU of fsdp_bench's measured GPT steps at W=2, fully_shard
against local training in both processes at once, by category and by thread.

    python3 tools/bench/profile_report.py DIR STEPS

DIR holds VARIANT.REP.rankR.perf.data (cpu-clock samples at 1000 Hz of the measured steps only) and
VARIANT.REP.json (fsdp_bench's results). A sample is one millisecond of one thread's CPU, so a
category's samples over the steps are its milliseconds per step. Each figure is the mean over the
two ranks, then the median over the repeats.
"""
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys

# (category, test on (symbol, dso)); the first that matches names the sample.
CATEGORIES = [
    ("kernel (system calls, scheduling, page faults)", lambda s, d: d.startswith("[kernel")),
    ("Open MPI (shared-memory transport, reductions, polling)",
     lambda s, d: re.search(r"libmpi|libopen-pal|libopen-rte|mca_|libpmix|libevent|libhwloc|libucp|libucs", d)),
    ("copies and fills (memcpy, memset, copy_/fill_ kernels)",
     lambda s, d: re.search(r"memcpy|memmove|memset|copy_kernel|copy_impl|direct_copy|fill_kernel|"
                            r"\bfill_|zero_|cat_serial|_copy_", s)),
    ("allocation (malloc/free, LibTorch's CPU allocator)",
     lambda s, d: re.search(r"malloc|\bfree\b|_int_free|cfree|posix_memalign|alloc_cpu|free_cpu|"
                            r"CPUAllocator|DefaultCPUAllocator|mmap|munmap|\bbrk\b|madvise", s)),
    ("LibTorch (kernels, dispatch, autograd)", lambda s, d: re.search(r"libtorch|libc10|libgomp|libmkl|libsleef", d)),
    ("libc and C++ runtime (locks, threads, other)", lambda s, d: re.search(r"libc\.so|libstdc\+\+|libm\.so|ld-linux", d)),
    ("fsdp_bench binary (this library, linked in)", lambda s, d: d.endswith("fsdp_bench")),
]
OTHER = "other"


def samples(path):
    """[(pid, tid, symbol, dso)] of one perf.data file."""
    out = subprocess.run(["perf", "script", "-i", path, "-F", "pid,tid,ip,sym,dso"], capture_output=True,
                         text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)/(\d+)\s+[0-9a-f]+\s+(.*)\s\(([^()]*)\)\s*$", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), m.group(3).strip(), os.path.basename(m.group(4))))
    return rows


def categorize(sym, dso):
    for name, test in CATEGORIES:
        if test(sym, dso):
            return name
    return OTHER


def run_figures(files, steps):
    """{row: ms per step per rank} over the ranks' files of one run."""
    per_rank = []
    for f in files:
        counts = collections.Counter()
        for pid, tid, sym, dso in samples(f):
            category = categorize(sym, dso)
            counts[category] += 1
            counts["symbol: " + (sym or "?") + " [" + dso + "]"] += 1
            counts["thread: training (main)" if pid == tid else "thread: others (MPI progress, watchdog)"] += 1
            counts["total"] += 1
        per_rank.append({k: v / steps for k, v in counts.items()})
    rows = set().union(*per_rank)
    return {k: statistics.mean(r.get(k, 0.0) for r in per_rank) for k in rows}


def json_figures(path, variant):
    """(median step ms of the slower rank, median process CPU ms per rank) from fsdp_bench's JSON."""
    data = json.load(open(path))
    steps, cpus = [], []
    for rank in data["ranks"]:
        v = rank["timing"]["gpt"]
        measured = v["variants"][variant]
        warm = v["warmup"]
        steps.append(measured["step_s"][warm:])
        cpus.append(statistics.median(measured["cpu_s"][warm:]) * 1e3)
    slower = [max(s) * 1e3 for s in zip(*steps)]
    return statistics.median(slower), statistics.mean(cpus)


def main():
    out, steps = sys.argv[1], int(sys.argv[2])
    figures = {}
    for variant in ("fsdp", "local"):
        reps = sorted({re.match(rf"{variant}\.(\d+)\.rank", os.path.basename(p)).group(1)
                       for p in glob.glob(os.path.join(out, f"{variant}.*.rank*.perf.data"))})
        runs = [run_figures(sorted(glob.glob(os.path.join(out, f"{variant}.{r}.rank*.perf.data"))), steps)
                for r in reps]
        timing = [json_figures(os.path.join(out, f"{variant}.{r}.json"), variant) for r in reps]
        rows = set().union(*runs)
        figures[variant] = {k: statistics.median(run.get(k, 0.0) for run in runs) for k in rows}
        figures[variant]["step ms (slower rank, wall)"] = statistics.median(t[0] for t in timing)
        figures[variant]["process CPU ms per rank (clock_gettime)"] = statistics.median(t[1] for t in timing)
        figures[variant]["runs"] = len(runs)
    order = (["step ms (slower rank, wall)", "process CPU ms per rank (clock_gettime)", "total"]
             + [c for c, _ in CATEGORIES] + [OTHER]
             + ["thread: training (main)", "thread: others (MPI progress, watchdog)"])
    f, l = figures["fsdp"], figures["local"]
    print(f"GPT step at W=2, per rank per measured step ({steps} steps; medians over {f['runs']} / "
          f"{l['runs']} runs; perf cpu-clock samples at 1000 Hz, 1 sample = 1 ms of one thread)")
    print(f"{'':58} {'fully_shard':>12} {'local x2':>10} {'difference':>11}")
    for k in order:
        a, b = f.get(k, 0.0), l.get(k, 0.0)
        print(f"{k:58} {a:12.2f} {b:10.2f} {a - b:+11.2f}")
    symbols = sorted((k for k in set(f) | set(l) if k.startswith("symbol: ")),
                     key=lambda k: -abs(f.get(k, 0.0) - l.get(k, 0.0)))
    print()
    print("the symbols that differ most (ms per rank per step)")
    for k in symbols[:25]:
        a, b = f.get(k, 0.0), l.get(k, 0.0)
        print(f"  {a:7.2f} {b:7.2f} {a - b:+7.2f}  {k[len('symbol: '):][:150]}")
    ratio = f["step ms (slower rank, wall)"] / l["step ms (slower rank, wall)"]
    print(f"step ratio fully_shard / concurrent-local: {ratio:.2f}x")


if __name__ == "__main__":
    main()
