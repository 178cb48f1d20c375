"""Full records (every=1): how long the training thread is blocked, and how fast the writer writes, against the
least any recorder can do with the same bytes: copy them (clone) and write them raw (numpy.tofile).

    python -m benchmarks.full_overhead [--quick] [--rounds N] [--steps N] [--width W] [--depth D] [--dir DIR]
                                       [--json FILE]

The loop is a wide MLP's AdamW step alone, on gradients computed once (the cheapest step there is, so what the
recorder does dominates). Blocks of steps, round-robin in one process, the order rotated each round:

* plain: the step alone;
* clone+tofile: after the step, a clone of what a full record holds (param, grad and state before the step, param
  after it) and numpy.tofile of those bytes into one file, on the training thread: the bare copy plus raw write;
* clone+tofile thread: the same clones, handed to a thread that writes them with tofile behind a queue of 2 (the
  recorder's own shape, with the least possible writer);
* upd: ``upd.record(path, model, opt, every=1)``, the writer thread behind its queue, ``close()`` inside the block.
  The run's first record, which creates the file's groups and datasets once per run, is written before the timed
  steps and reported apart: over a block of 30 small records it would add 2-3 ms to each.

Reported: the training thread's time blocked per step (upd's median step - plain's, same round) against
clone+tofile's (its median step - plain's; target: at most 2x), and the writer's throughput, the bytes its thread
wrote over the time it spent in ``RunWriter.write`` (``AsyncRunWriter.write_seconds``), against tofile's (target: at
least 0.7x). The fair tofile to compare with is the one on a thread: it runs while the training thread copies the
next record, on the same cores, as the writer does; tofile on the training thread runs alone between steps (also
reported). Both by wall clock and by the writing thread's own CPU time, per round, medians of the ratios. Also end
to end: the record bytes over the block's time beyond the plain block's, close() included, for upd and for the
tofile thread. ``--width 256 --depth 2`` (2.7 MB per record, more ``--steps``) shows a record's fixed cost.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import shutil
import statistics
import tempfile
import threading
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


def timed_steps(steps: int, step) -> dict:
    """Wall and thread-CPU time of each of `steps` calls of step() (medians), and the block's total wall time."""
    times, cpu = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return {"median": median(times), "cpu": median(cpu), "total": time.perf_counter() - t0}


def block_plain(loop: StepLoop, steps: int, path: str) -> dict:
    return timed_steps(steps, loop.opt.step)


def cloned_step(loop: StepLoop) -> list:
    """The step with the copies a full record takes: everything it holds before the step, the params after it."""
    copies = [t.clone() for t in loop.record_tensors()]
    loop.opt.step()
    return copies + [p.detach().clone() for p in loop.params]


def block_clone_tofile(loop: StepLoop, steps: int, path: str) -> dict:
    written = {"wall": 0.0, "cpu": 0.0}
    with open(path, "wb") as f:
        def step():
            copies = cloned_step(loop)
            w, wc = time.perf_counter(), time.thread_time()
            for x in copies:
                x.numpy().tofile(f)
            written["wall"] += time.perf_counter() - w
            written["cpu"] += time.thread_time() - wc

        out = timed_steps(steps, step)
        f.flush()
    return {**out, "write": written["wall"], "write_cpu": written["cpu"]}


def block_clone_tofile_thread(loop: StepLoop, steps: int, path: str) -> dict:
    """The same copies, handed to a thread that writes them with tofile behind a queue of 2: the recorder's shape
    with the least possible writer, so that its throughput is measured under the same load as upd's writer."""
    pending: queue.Queue = queue.Queue(maxsize=2)
    written = {"wall": 0.0, "cpu": 0.0}

    def write_all():
        with open(path, "wb") as f:
            while (copies := pending.get()) is not None:
                w, wc = time.perf_counter(), time.thread_time()
                for x in copies:
                    x.numpy().tofile(f)
                written["wall"] += time.perf_counter() - w
                written["cpu"] += time.thread_time() - wc
                copies = None

    thread = threading.Thread(target=write_all)
    thread.start()
    t0 = time.perf_counter()
    out = timed_steps(steps, lambda: pending.put(cloned_step(loop)))
    pending.put(None)
    thread.join()
    return {**out, "total": time.perf_counter() - t0, "write": written["wall"], "write_cpu": written["cpu"]}


def block_upd(loop: StepLoop, steps: int, path: str) -> dict:
    """The run's first record, which creates its groups and datasets (a cost per run, not per record: 60-80 ms of
    writer CPU on the 6-parameter model), is written before the timed steps and reported on its own."""
    rec = upd.record(path, loop.model, loop.opt, every=1, overwrite=True)
    writer = rec._writer
    clock = time.pthread_getcpuclockid(writer._thread.ident)
    first_cpu = time.clock_gettime(clock)
    loop.opt.step()
    while writer.records_written < 1 and writer.error is None:
        time.sleep(0.001)
    writer_cpu = time.clock_gettime(clock)
    first = {"first_seconds": writer.write_seconds, "first_cpu": writer_cpu - first_cpu}
    first_bytes = writer.bytes_written
    t0 = time.perf_counter()
    out = timed_steps(steps, loop.opt.step)
    blocked = getattr(writer, "blocked_seconds", float("nan"))
    while writer.records_written < steps + 1 and writer.error is None:  # the writer thread catches up
        time.sleep(0.001)
    writer_cpu = time.clock_gettime(clock) - writer_cpu
    rec.close()
    out["total"] = time.perf_counter() - t0  # close() included: the writer's backlog counts
    if rec.error is not None:
        raise RuntimeError(f"the recorder stopped: {rec.error!r}")
    return {**out, **first, "queue_wait": blocked, "writer_bytes": writer.bytes_written - first_bytes,
            "writer_seconds": writer.write_seconds - first["first_seconds"], "writer_cpu": writer_cpu}


BLOCKS = {"plain": block_plain, "clone+tofile": block_clone_tofile,
          "clone+tofile thread": block_clone_tofile_thread, "upd": block_upd}


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

    def per_round(fn):
        return [fn(res["plain"][i], res["clone+tofile"][i], res["clone+tofile thread"][i], res["upd"][i])
                for i in rounds]

    written = nbytes * args.steps
    blocked = per_round(lambda plain, bare, thread, u: u["median"] - plain["median"])
    bare = per_round(lambda plain, bare, thread, u: bare["median"] - plain["median"])
    blocked_cpu = per_round(lambda plain, bare, thread, u: u["cpu"] - plain["cpu"])
    bare_cpu = per_round(lambda plain, bare, thread, u: bare["cpu"] - plain["cpu"])
    # Throughputs: bytes over the writing thread's own time writing them (wall, then its CPU time).
    writer = [x["writer_bytes"] / max(1e-9, x["writer_seconds"]) for x in res["upd"]]
    writer_cpu = [x["writer_bytes"] / max(1e-9, x["writer_cpu"]) for x in res["upd"]]
    tofile = [written / x["write"] for x in res["clone+tofile"]]
    tofile_cpu = [written / x["write_cpu"] for x in res["clone+tofile"]]
    thread = [written / x["write"] for x in res["clone+tofile thread"]]
    thread_cpu = [written / x["write_cpu"] for x in res["clone+tofile thread"]]
    # End to end: the record bytes over the block's time beyond the plain block's (the writer's backlog included).
    end_to_end = per_round(lambda plain, bare, thread, u: written / max(1e-9, u["total"] - plain["total"]))
    thread_end_to_end = per_round(lambda plain, bare, thread, u: written / max(1e-9, thread["total"] - plain["total"]))

    def ratio(xs, ys):
        return median([x / y for x, y in zip(xs, ys)])

    out = {
        "desc": loop.desc, "rounds": args.rounds, "steps": args.steps, "record_bytes": nbytes,
        "plain_ms": median([x["median"] for x in res["plain"]]) * 1e3,
        "blocked_ms": median(blocked) * 1e3, "bare_ms": median(bare) * 1e3,
        "blocked_vs_bare": ratio(blocked, bare),
        "blocked_cpu_ms": median(blocked_cpu) * 1e3, "bare_cpu_ms": median(bare_cpu) * 1e3,
        "blocked_vs_bare_cpu": ratio(blocked_cpu, bare_cpu),
        "queue_wait_ms_per_step": median([x["queue_wait"] for x in res["upd"]]) / args.steps * 1e3,
        "writer_mb_s": median(writer) / MB, "writer_cpu_mb_s": median(writer_cpu) / MB,
        "thread_tofile_mb_s": median(thread) / MB, "thread_tofile_cpu_mb_s": median(thread_cpu) / MB,
        "tofile_mb_s": median(tofile) / MB, "tofile_cpu_mb_s": median(tofile_cpu) / MB,
        "writer_vs_thread_tofile": ratio(writer, thread), "writer_vs_thread_tofile_cpu": ratio(writer_cpu, thread_cpu),
        "writer_vs_tofile": ratio(writer, tofile), "writer_vs_tofile_cpu": ratio(writer_cpu, tofile_cpu),
        "end_to_end_mb_s": median(end_to_end) / MB, "thread_end_to_end_mb_s": median(thread_end_to_end) / MB,
        "end_to_end_vs_thread": ratio(end_to_end, thread_end_to_end),
        "first_record_ms": median([x["first_seconds"] for x in res["upd"]]) * 1e3,
        "first_record_cpu_ms": median([x["first_cpu"] for x in res["upd"]]) * 1e3,
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
| upd's writer thread: bytes written / its time writing | {out['writer_mb_s']:.0f} MB/s | \
{out['writer_cpu_mb_s']:.0f} MB/s |
| tofile on a thread behind a queue of 2, while training (same load as the writer) | \
{out['thread_tofile_mb_s']:.0f} MB/s | {out['thread_tofile_cpu_mb_s']:.0f} MB/s |
| **writer / tofile on a thread** (target >= 0.7) | **{out['writer_vs_thread_tofile']:.2f}** | \
**{out['writer_vs_thread_tofile_cpu']:.2f}** |
| tofile on the training thread, alone between steps | {out['tofile_mb_s']:.0f} MB/s | \
{out['tofile_cpu_mb_s']:.0f} MB/s |
| writer / tofile alone | {out['writer_vs_tofile']:.2f} | {out['writer_vs_tofile_cpu']:.2f} |
| end to end, record bytes / (block incl. close - plain block): upd; tofile thread | \
{out['end_to_end_mb_s']:.0f}; {out['thread_end_to_end_mb_s']:.0f} MB/s | |
| end to end: upd / tofile thread | {out['end_to_end_vs_thread']:.2f} | |
| upd's first record of a run (creates its datasets; before the timed steps, in none of the above) | \
{out['first_record_ms']:.1f} ms | {out['first_record_cpu_ms']:.1f} ms |

load average (1 min) {out['load_average'][0]:.2f} at start, {out['load_average'][1]:.2f} at end""")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": out, "blocks": res}, f, indent=1)


if __name__ == "__main__":
    main()
