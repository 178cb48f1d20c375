"""What `upd info`, `upd analyze` and `upd verify` cost on large valid runs: wall time and peak memory.

    python -m benchmarks.reading_cost [--quick] [--runs DIR] [--commands info,analyze,verify]

Two real runs, recorded here once and kept in --runs (default: a folder in the temporary directory):
- many parameters: 5,000 one-element parameters (Adam, 3 steps; --quick: 1,000), where the per-parameter cost of
  opening and checking a run dominates; read twice: as recorded (listed from its parameter index, docs/format.md)
  and as a copy without the index (as a file of an earlier recorder, read parameter group by parameter group);
- one big parameter: a single 5000x10000 float32 parameter (200 MB; SGD, 3 steps, a 1.8 GB file; --quick:
  1000x5000, 20 MB), where the cost of one block dominates.

Each command runs in a fresh interpreter (as `python -m upd` would), which reports its own peak RSS (VmHWM: Linux);
its CPU time (user + system) is measured too: on a shared machine wall time includes waiting for a core. The
baseline, measured in the same run the same way, is the command on the committed sample run sample_runs/adam.h5
(four small parameters): the interpreter with upd and what the command imports. Ratios are against it; figures:
docs/performance.md, "Reading cost".
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import h5py
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO_ROOT, "sample_runs", "adam.h5")
COMMAND_ARGS = {"info": ["info"], "analyze": ["analyze", "--no-plots"], "verify": ["verify"]}


def record_many_params(path: str, count: int) -> None:
    import upd

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(1)) for _ in range(count)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(path, model, opt, every=1, overwrite=True):
        for _ in range(3):
            opt.zero_grad()
            sum((p * p).sum() for p in model.p).backward()
            opt.step()


def record_big_param(path: str, shape: tuple) -> None:
    import upd

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(*shape) * 0.02)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with upd.record(path, model, opt, every=1, overwrite=True):
        for _ in range(3):
            opt.zero_grad()
            (model.w * model.w).sum().backward()
            opt.step()


# The command inside a fresh interpreter that reports its own peak RSS (VmHWM) on its last stderr line. Not
# os.wait4's ru_maxrss: on Linux a child's starts at its parent's RSS when it was forked (here: torch and a recorder).
CHILD = """
import sys
from upd.cli.main import main
try:
    main(sys.argv[1:], prog_name="upd")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
sys.stderr.write(f"\\nVmHWM_KB={peak}\\n")
sys.exit(code)
"""


def without_index(path: str, copy: str) -> None:
    """A copy of a recorded run without its parameter index: how a run of an earlier recorder reads."""
    from upd.runfile import schema

    shutil.copy(path, copy)
    with h5py.File(copy, "r+") as f:
        for opt in f[schema.OPTIMIZERS].values():
            opt[schema.PARAMS].attrs.pop(schema.PARAM_INDEX, None)


def measure(command: str, path: str) -> tuple[float, float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MB, exit code) of `upd COMMAND PATH` in a fresh interpreter."""
    started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", CHILD, *COMMAND_ARGS[command], path], cwd=REPO_ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    lines = proc.stderr.strip().splitlines()
    peak_kb = int(lines[-1].split("=")[1]) if lines and lines[-1].startswith("VmHWM_KB=") else 0
    if proc.returncode not in (0, 1):
        print(f"  {command} {os.path.basename(path)}: exit {proc.returncode}: {' '.join(lines[:-1])[-300:]}",
              file=sys.stderr)
    return seconds, cpu, peak_kb / 1024, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000 parameters and a 20 MB parameter")
    parser.add_argument("--runs", default=os.path.join(tempfile.gettempdir(), "upd-reading-cost"),
                        help="folder for the recorded runs (kept between invocations)")
    parser.add_argument("--commands", default="info,analyze,verify")
    args = parser.parse_args()
    os.makedirs(args.runs, exist_ok=True)
    count, shape = (1000, (1000, 5000)) if args.quick else (5000, (5000, 10000))
    runs = {f"{count} one-element parameters": (os.path.join(args.runs, f"many-{count}.h5"),
                                                lambda p: record_many_params(p, count)),
            f"one {shape[0]}x{shape[1]} parameter": (os.path.join(args.runs, f"big-{shape[0]}x{shape[1]}.h5"),
                                                    lambda p: record_big_param(p, shape))}
    for label, (path, make) in runs.items():
        if not os.path.exists(path):
            print(f"recording {label} -> {path}", flush=True)
            started = time.perf_counter()
            make(path)
            print(f"  recorded in {time.perf_counter() - started:.0f} s", flush=True)
    many = runs[f"{count} one-element parameters"][0]
    old_style = os.path.join(args.runs, f"many-{count}-no-index.h5")
    without_index(many, old_style)
    runs = {f"{count} params, listed from index": (many, None), f"{count} params, no index": (old_style, None),
            **{k: v for k, v in runs.items() if v[0] != many}}
    commands = args.commands.split(",")
    baseline = {c: measure(c, SAMPLE) for c in commands}
    print(f"\n{'run':<34} {'command':<8} {'size MB':>8} {'seconds':>8} {'cpu s':>6} {'x base':>7} {'peak MB':>8} "
          f"{'x base':>7}")
    for c in commands:
        s, cpu, m, _ = baseline[c]
        print(f"{'baseline: sample_runs/adam.h5':<34} {c:<8} {os.path.getsize(SAMPLE) / 1e6:>8.1f} {s:>8.2f} "
              f"{cpu:>6.2f} {1:>7.2f} {m:>8.0f} {1:>7.2f}")
    for label, (path, _) in runs.items():
        for c in commands:
            s, cpu, m, code = measure(c, path)
            bs, bcpu, bm, _ = baseline[c]
            print(f"{label:<34} {c:<8} {os.path.getsize(path) / 1e6:>8.1f} {s:>8.2f} {cpu:>6.2f} {cpu / bcpu:>7.2f} "
                  f"{m:>8.0f} {m / bm:>7.2f}" + ("" if code in (0, 1) else f"  (exit {code})"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
