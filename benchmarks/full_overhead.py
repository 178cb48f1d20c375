"""Full records (every=1): how long the training thread is blocked, and how fast the writer writes, against the
least any recorder can do with the same bytes: copy them (clone) and write them raw (numpy.tofile).

    python -m benchmarks.full_overhead [--quick] [--rounds N] [--steps N] [--width W] [--dir DIR] [--json FILE]

The loop is a wide MLP's AdamW step alone, on gradients computed once (the cheapest step there is, so what the
recorder does dominates). Blocks of steps, round-robin in one process, the order rotated each round:

* plain: the step alone;
* clone+tofile: after the step, a clone of what a full record holds (param, grad and state before the step, param
  after it) and numpy.tofile of those bytes into one file, on the training thread: the bare copy plus raw write;
* upd: ``upd.record(path, model, opt, every=1)``, the writer thread behind its queue, ``close()`` inside the block.

Reported: the training thread's time blocked per step (upd's median step - plain's, same round) against
clone+tofile's (its median step - plain's; target: at most 2x), and the writer's throughput, the bytes its thread
wrote over the time it spent in ``RunWriter.write`` (``AsyncRunWriter.write_seconds``), against tofile's own
throughput measured inside the clone+tofile block (target: at least 0.7x). Also the recorder end to end: the
record bytes over the upd block's time beyond the plain block's, close() included.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import upd

MB = 1e6


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class StepLoop:
    def __init__(self, width: int, depth: int):
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.model = nn.Sequential(*layers, nn.Linear(width, 10))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        x = torch.randn(8, width)
        F.cross_entropy(self.model(x), torch.randint(0, 10, (8,))).backward()
        self.opt.step()  # creates the state
        self.params = [p for p in self.model.parameters()]
        self.nbytes = sum(p.numel() * p.element_size() * 3 + sum(
            s.numel() * s.element_size() for s in self.opt.state[p].values()) for p in self.params)
        n = sum(p.numel() for p in self.params)
        self.desc = (f"MLP, {depth} x Linear({width}, {width}): {n / 1e6:.1f}M parameters, AdamW step alone; "
                     f"{self.nbytes / MB:.0f} MB per full record")

    def record_tensors(self) -> list:
        """What a full record holds before the step: param, grad and every state tensor."""
        out = []
        for p in self.params:
            out += [p.detach(), p.grad] + [s for s in self.opt.state[p].values()]
        return out


def block_plain(loop: StepLoop, steps: int, path: str) -> dict:
    times, cpu = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        loop.opt.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return {"median": median(times), "cpu": median(cpu), "total": time.perf_counter() - t0}


def block_clone_tofile(loop: StepLoop, steps: int, path: str) -> dict:
    times, cpu, write, write_cpu = [], [], 0.0, 0.0
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(steps):
            t, c = time.perf_counter(), time.thread_time()
            copies = [t_.clone() for t_ in loop.record_tensors()]
            loop.opt.step()
            copies += [p.detach().clone() for p in loop.params]
            w, wc = time.perf_counter(), time.thread_time()
            for x in copies:
                x.numpy().tofile(f)
            write += time.perf_counter() - w
            write_cpu += time.thread_time() - wc
            times.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            del copies
        f.flush()
    return {"median": median(times), "cpu": median(cpu), "total": time.perf_counter() - t0, "write": write,
            "write_cpu": write_cpu}


def block_upd(loop: StepLoop, steps: int, path: str) -> dict:
    rec = upd.record(path, loop.model, loop.opt, every=1, overwrite=True)
    clock = time.pthread_getcpuclockid(rec._writer._thread.ident)
    writer_cpu = time.clock_gettime(clock)
    times, cpu = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        loop.opt.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    blocked = getattr(rec._writer, "blocked_seconds", float("nan"))
    while rec._writer.records_written < steps and rec._writer.error is None:  # the writer thread catches up
        time.sleep(0.001)
    writer_cpu = time.clock_gettime(clock) - writer_cpu
    rec.close()
    total = time.perf_counter() - t0
    if rec.error is not None:
        raise RuntimeError(f"the recorder stopped: {rec.error!r}")
    writer = rec._writer
    return {"median": median(times), "cpu": median(cpu), "total": total, "queue_wait": blocked,
            "writer_bytes": getattr(writer, "bytes_written", 0), "writer_seconds": getattr(writer, "write_seconds", 0),
            "writer_cpu": writer_cpu}


BLOCKS = {"plain": block_plain, "clone+tofile": block_clone_tofile, "upd": block_upd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the files go (default: the system temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 2
    torch.set_num_threads(args.threads)
    warnings.simplefilter("error", upd.RecorderWarning)
    loop = StepLoop(args.width, args.depth)
    workdir = tempfile.mkdtemp(prefix="upd-full-bench-", dir=args.dir)
    print(f"## {loop.desc}; {args.rounds} rounds x {args.steps} steps per block", flush=True)
    load_start = os.getloadavg()[0]
    res = {k: [] for k in BLOCKS}
    names = list(BLOCKS)
    try:
        for r in range(args.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                path = os.path.join(workdir, f"{name}.bin")
                loop.opt.step()  # untimed: settles the allocator after the previous block
                res[name].append(BLOCKS[name](loop, args.steps, path))
                if os.path.exists(path):
                    os.remove(path)
            print(f"  round {r + 1}: " + "  ".join(f"{k} {res[k][-1]['median'] * 1e3:.0f} ms/step "
                                                    f"({res[k][-1]['total']:.2f} s)" for k in names), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    nbytes = loop.nbytes
    rounds = range(args.rounds)
    blocked = [res["upd"][i]["median"] - res["plain"][i]["median"] for i in rounds]
    bare = [res["clone+tofile"][i]["median"] - res["plain"][i]["median"] for i in rounds]
    end_to_end = [nbytes * args.steps / max(1e-9, res["upd"][i]["total"] - res["plain"][i]["total"]) for i in rounds]
    writer = [x["writer_bytes"] / max(1e-9, x["writer_seconds"]) for x in res["upd"]]
    tofile = [nbytes * args.steps / res["clone+tofile"][i]["write"] for i in rounds]
    writer_cpu = [x["writer_bytes"] / max(1e-9, x["writer_cpu"]) for x in res["upd"]]
    tofile_cpu = [nbytes * args.steps / res["clone+tofile"][i]["write_cpu"] for i in rounds]
    blocked_cpu = [res["upd"][i]["cpu"] - res["plain"][i]["cpu"] for i in rounds]
    bare_cpu = [res["clone+tofile"][i]["cpu"] - res["plain"][i]["cpu"] for i in rounds]
    out = {
        "desc": loop.desc, "rounds": args.rounds, "steps": args.steps, "record_bytes": nbytes,
        "plain_ms": median([x["median"] for x in res["plain"]]) * 1e3,
        "blocked_ms": median(blocked) * 1e3, "bare_ms": median(bare) * 1e3,
        "blocked_vs_bare": median([b / a for a, b in zip(bare, blocked)]),
        "queue_wait_ms_per_step": median([x["queue_wait"] for x in res["upd"]]) / args.steps * 1e3,
        "writer_mb_s": median(writer) / MB, "tofile_mb_s": median(tofile) / MB,
        "end_to_end_mb_s": median(end_to_end) / MB,
        "blocked_cpu_ms": median(blocked_cpu) * 1e3, "bare_cpu_ms": median(bare_cpu) * 1e3,
        "blocked_vs_bare_cpu": median([b / a for a, b in zip(bare_cpu, blocked_cpu)]),
        "writer_cpu_mb_s": median(writer_cpu) / MB, "tofile_cpu_mb_s": median(tofile_cpu) / MB,
        "writer_vs_tofile_cpu": median([w / t for w, t in zip(writer_cpu, tofile_cpu)]),
        "writer_vs_tofile": median([w / t for w, t in zip(writer, tofile)]),
        "load_average": [load_start, os.getloadavg()[0]],
    }
    print(f"""
| measure | wall clock | CPU time (the thread's own) |
|---|---|---|
| plain step | {out['plain_ms']:.1f} ms | |
| clone + tofile of the record, on the training thread: step - plain | {out['bare_ms']:.1f} ms | \
{out['bare_cpu_ms']:.1f} ms |
| upd every=1: training thread blocked per step (step - plain) | {out['blocked_ms']:.1f} ms | \
{out['blocked_cpu_ms']:.1f} ms |
| of which waiting for queue space (per step) | {out['queue_wait_ms_per_step']:.1f} ms | |
| **blocked / (clone + tofile)** (target <= 2) | **{out['blocked_vs_bare']:.2f}** | \
**{out['blocked_vs_bare_cpu']:.2f}** |
| writer thread: bytes written / its time writing | {out['writer_mb_s']:.0f} MB/s | {out['writer_cpu_mb_s']:.0f} MB/s |
| recorder end to end: record bytes / (upd block incl. close - plain block) | {out['end_to_end_mb_s']:.0f} MB/s | |
| numpy.tofile inside the clone+tofile block | {out['tofile_mb_s']:.0f} MB/s | {out['tofile_cpu_mb_s']:.0f} MB/s |
| **writer / tofile** (target >= 0.7) | **{out['writer_vs_tofile']:.2f}** | **{out['writer_vs_tofile_cpu']:.2f}** |

load average (1 min) {out['load_average'][0]:.2f} at start, {out['load_average'][1]:.2f} at end""")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": out, "blocks": res}, f, indent=1)


if __name__ == "__main__":
    main()
