"""How fast `upd verify` and `run.ratios()` read a run, against reading the same bytes, and how much memory verify
needs for one large parameter. Figures in docs/performance.md ("Verify and ratios at disk speed").

    python -m benchmarks.verify_speed                 # speed: a ~300 MB run, 3 rounds, jobs 1 and 2 (~3 min)
    python -m benchmarks.verify_speed --memory        # peak memory: one 5000 x 10000 parameter, 3 steps (1.8 GB)

Speed: the reference transformer of benchmarks/overhead.py (AdamW, 116 MB of run file per step) is recorded with
full tensors at every step into a temporary folder. Each round then measures, one after another in this process
with one torch thread:

- `h5py read`: plain h5py reads every dataset of the file whole: the bytes, without any work on them (baseline);
- `verify`: `upd.verify(path)`, opening the file; `verify, run already open`: `upd.verify(run)` on a run opened
  (and its datasets validated, which the reader does on first use) before: the replay and its reads alone;
- `verify --jobs 2`: `upd.verify(path, jobs=2)`, 2 worker processes (wall time, including their start; the
  worker server, which imports torch once, is started before the rounds and its start reported on its own);
- `ratios`: `upd.open_run(path).ratios()`.

Throughput is MB of run file per second. The machine is shared, so each figure is also divided by the baseline
measured in the same round, and the table shows the median over rounds. CPU seconds of this process are shown
beside wall seconds because they move less with the load of other processes (not for --jobs, whose workers are
not this process's children: each worker reports its own CPU seconds, upd.replay.parallel.WORKER_CPU).

A second table says how --jobs scales: wall time against --jobs 1 in the same round, and, because on a loaded
machine the processes may share one core, what it would be with a core per process: the serial CPU seconds over
the CPU seconds of the busiest process (this one replays too, from the small end of the queue; --jobs N is this
process and N - 1 workers). The load average of each round is printed with it.

Memory: one 5000 x 10000 float32 parameter trained 3 steps with SGD (param, grad, param after: 600 MB a step).
Each variant runs `upd.verify` in a fresh process and reports its peak resident memory (VmHWM), and that peak
above the resident memory after imports: as verify runs now (block by block), and with the block and chunk sizes
set past the parameter's size, i.e. one tensor replayed whole (what verify did before it worked in blocks; its own
figure was 4.1-4.2 GB).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import h5py
import torch

import upd

MB = 1e6


def record_transformer(path: str, steps: int) -> None:
    from benchmarks.overhead import gpt_workload

    w = gpt_workload()
    with upd.record(path, w.model, w.opt, every=1, overwrite=True):
        for _ in range(steps):
            w.forward_backward()
            w.opt.step()


def read_every_dataset(path: str) -> None:
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                obj[()]
        f.visititems(visit)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    def cpu():
        me = resource.getrusage(resource.RUSAGE_SELF)
        return me.ru_utime + me.ru_stime
    t, c = time.perf_counter(), cpu()
    fn()
    return time.perf_counter() - t, cpu() - c


def speed(args) -> None:
    from upd.replay import parallel

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "transformer.h5")
        record_transformer(path, args.steps)
        size = os.path.getsize(path)
        expected = upd.verify(path)  # warm: imports, page cache
        assert expected.exit_code == 0, expected.summary()
        opened = upd.open_run(path)
        upd.verify(opened)  # its datasets are validated on first use, once
        started = time.perf_counter()
        upd.verify(path, jobs=max(args.jobs))  # starts the worker server (once per process): torch imported there
        server_start = time.perf_counter() - started
        variants = {
            "h5py read (baseline)": lambda: read_every_dataset(path),
            "verify": lambda: upd.verify(path),
            "verify, run already open": lambda: upd.verify(opened),
            **{f"verify --jobs {j}": (lambda j=j: upd.verify(path, jobs=j)) for j in args.jobs},
            "ratios()": lambda: upd.open_run(path).ratios(),
        }
        rows = {name: [] for name in variants}
        workers = {j: [] for j in args.jobs}  # per round: {worker pid: CPU seconds}
        loads = []
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, fn in variants.items():
                rows[name].append(timed(fn))
                if "jobs" in name:
                    workers[int(name.split()[-1])].append(dict(parallel.WORKER_CPU))
            print(f"round {r + 1}/{args.rounds} (load average {loads[-1]:.1f}): " + ", ".join(
                f"{name} {size / MB / rows[name][-1][0]:.0f} MB/s" for name in variants), flush=True)
        base = rows["h5py read (baseline)"]
        print(f"\nrun: {size / MB:.0f} MB ({args.steps} steps of the reference transformer, AdamW); "
              f"median of {args.rounds} rounds, one torch thread; load average (1 min) {min(loads):.1f}-"
              f"{max(loads):.1f} on {os.cpu_count()} cores\n")
        print("| what | MB/s (wall) | x baseline (wall) | MB/s (CPU) | x baseline (CPU) |")
        print("|---|---|---|---|---|")
        for name, times in rows.items():
            wall = statistics.median(size / MB / w for w, _ in times)
            x_wall = statistics.median(b[0] / w for (w, _), b in zip(times, base))
            if "jobs" in name:  # the workers are the forkserver's children, not this process's: their CPU below
                print(f"| {name} | {wall:.0f} | {x_wall:.2f} | - | - |")
                continue
            cpu = statistics.median(size / MB / c for _, c in times)
            x_cpu = statistics.median(b[1] / c for (_, c), b in zip(times, base))
            print(f"| {name} | {wall:.0f} | {x_wall:.2f} | {cpu:.0f} | {x_cpu:.2f} |")
        opened.close()
        serial_cpu = statistics.median(c for _, c in rows["verify"])
        print(f"\nworker server start (once per process, before the first --jobs verify): {server_start:.1f} s wall")
        print("\n| jobs | wall s | x --jobs 1 (wall, same round) | this process's CPU s | workers' CPU s | all CPU s "
              "| x --jobs 1 with a core per process |")
        print("|---|---|---|---|---|---|---|")
        print(f"| 1 | {statistics.median(w for w, _ in rows['verify']):.2f} | 1.00 | {serial_cpu:.2f} | - | "
              f"{serial_cpu:.2f} | 1.00 |")
        me = os.getpid()
        for j in args.jobs:
            times = rows[f"verify --jobs {j}"]
            scaling = statistics.median(one[0] / many[0] for one, many in zip(rows["verify"], times))
            parent = statistics.median(c for _, c in times)
            others = [sorted((v for pid, v in w.items() if pid != me), reverse=True) for w in workers[j]]
            each = " + ".join(f"{statistics.median(o[k] if k < len(o) else 0.0 for o in others):.2f}"
                              for k in range(max(map(len, others)))) or "-"
            total = statistics.median(c + sum(o) for (_, c), o in zip(times, others))
            # the processes run side by side: with a core each, the wall time is the busiest one's CPU time
            projected = statistics.median(serial_cpu / max([c, *o]) for (_, c), o in zip(times, others))
            print(f"| {j} | {statistics.median(w for w, _ in times):.2f} | {scaling:.2f} | {parent:.2f} | {each} | "
                  f"{total:.2f} | {projected:.2f} |")


MEMORY_CHILD = """
import sys, torch
import upd
from upd.replay import blocks
from upd.runfile import tensor_blocks
torch.set_num_threads(1)
if sys.argv[2] == "whole":
    tensor_blocks.BLOCK_ELEMENTS = blocks.CHUNK_ELEMENTS = 1 << 40
def status(field):
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the parent (which recorded the run)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
start = status("VmRSS")  # resident now, after imports
report = upd.verify(sys.argv[1])
print(start, status("VmHWM"), report.exit_code, report.matched)
"""


def memory(args) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "large.h5")
        torch.manual_seed(0)
        layer = torch.nn.Linear(10000, 5000, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=0.01)
        with upd.record(path, layer, opt, every=1, overwrite=True):
            for _ in range(3):
                opt.zero_grad()
                layer(torch.randn(4, 10000)).square().mean().backward()
                opt.step()
        print(f"run: one 5000 x 10000 float32 parameter (200 MB), 3 SGD steps, {os.path.getsize(path) / MB:.0f} MB "
              "file\n")
        print("| verify | peak RSS | above RSS after imports | seconds | exit code |")
        print("|---|---|---|---|---|")
        for mode, label in (("blocks", "block by block (now)"), ("whole", "whole tensor (as before)")):
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, path, mode], capture_output=True, text=True,
                                 check=True).stdout.split()
            start, peak, code = int(out[0]), int(out[1]), int(out[2])
            print(f"| {label} | {peak / MB:.0f} MB | {(peak - start) / MB:.0f} MB | {time.perf_counter() - t:.1f} | "
                  f"{code} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", action="store_true", help="peak memory on one 200 MB parameter instead of speed")
    ap.add_argument("--steps", type=int, default=3, help="recorded steps of the speed run (116 MB each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, nargs="+", default=[2], help="worker counts of the --jobs rows (default: 2)")
    ap.add_argument("--dir", default=None, help="where the run goes (default: the temporary folder)")
    args = ap.parse_args()
    memory(args) if args.memory else speed(args)


if __name__ == "__main__":
    main()
