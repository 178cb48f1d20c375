"""What recording costs a training loop: every figure a ratio measured side by side in one run.

    python -m benchmarks.overhead [--quick] [--threads N] [--dir DIR] [--diagnose] [--json FILE]

Sections (docs/performance.md has the figures and how to read them; benchmarks/README.md how to run):

1. step overhead: two CPU workloads trained with AdamW, (a) the reference, a ~5.8M-parameter GPT-style transformer,
   and (b) a wide MLP whose step is cheap for its parameter count. The variants of the training loop run in short
   blocks, round-robin in one process, the order rotated each round; each block's median step time is divided by
   the plain loop's median in the same round, and the table shows the median of those ratios over rounds, by wall
   clock and by process CPU time. Variants: plain; upd statistics mode (every=None, stats_every=1); the floor (one
   snapshot copy of the parameters, then one torch reduction over each param, grad, update and optimizer-state
   tensor, batched with torch._foreach_norm, one trip to the host); the seed question's naive loop; a
   per-parameter .item() norms logger; a bare clone of everything full mode copies; upd full tensors (every=1).
2. full tensors: on the MLP's optimizer step alone (fixed gradients, no forward/backward), the time the training
   thread is blocked per step against a bare clone of the same tensors, and the writer's sustained MB/s against
   numpy.tofile of the same bytes to the same directory, interleaved; then peak memory of plain / stats / full
   recording, each in a fresh process.
3. analyzer: upd.open_run(p).ratios() and upd.verify(p) on full-tensor runs of N and 2N steps, each call in a fresh
   process: MB/s of file, and peak memory against file size.

Peak memory is the peak resident set size (VmHWM in /proc/self/status, reset by writing 5 to /proc/self/clear_refs
at the start of the measured phase) minus the resident set size at that start, in a fresh process started with
MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns large freed blocks at once and RSS follows live memory. torch
does not allocate through Python's allocator, so tracemalloc would miss its tensors. Where clear_refs is not
writable the peak is since process start (an upper bound), and the flag says so in the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import upd

MB = 1e6  # throughput and sizes in decimal megabytes (MB/s)


# -- environment ------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def mount_of(path: str) -> str:
    """'device on mountpoint (fstype)' for the filesystem holding path, from /proc/mounts."""
    path = os.path.realpath(path)
    best = ("?", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    return f"{best[0]} on {best[1]} ({best[2]})"


def git_revision() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "") if rev else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def stats_mode_available() -> bool:
    return "stats_every" in inspect.signature(upd.Recorder.__init__).parameters


def environment(args, workdir: str) -> dict:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "h5py": h5py.version.version,
        "hdf5": h5py.version.hdf5_version,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "upd": f"{upd.__version__} ({git_revision()})",
        "disk": mount_of(workdir),
        "load_average_start": round(os.getloadavg()[0], 2),
        "quick": bool(args.quick),
    }


# -- peak memory ------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakRSS:
    """Peak resident set size above the resident set size at entry, in bytes (see the module docstring)."""

    def __enter__(self):
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.start = _status_kb("VmRSS") * 1024
        self.delta = 0
        return self

    def __exit__(self, *exc):
        self.delta = max(0, _status_kb("VmHWM") * 1024 - self.start)
        return False


# -- workloads --------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + positional embedding, N pre-LayerNorm blocks (causal self-attention, MLP), final LayerNorm, untied
    head: nanoGPT's shape at a CPU-friendly size."""

    def __init__(self, vocab=2048, ctx=64, d=256, layers=6, heads=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.lnf(x))


class Workload:
    def __init__(self, name: str, model: nn.Module, batches: list, loss_fn, desc: str):
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        self.batches = batches
        self.loss_fn = loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.desc = desc
        self.i = 0

    def forward_backward(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, self.batches[self.i % len(self.batches)])
        loss.backward()
        self.i += 1

    def step(self, variant) -> None:
        self.forward_backward()
        variant.before(self)
        self.opt.step()
        variant.after(self)


def token_batches(vocab: int, ctx: int, batch: int):
    """Four fixed batches of random tokens and the next-token loss a GPT workload trains on."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, vocab, (batch, ctx), generator=gen),
                torch.randint(0, vocab, (batch, ctx), generator=gen)) for _ in range(4)]

    def loss_fn(m, b):
        x, y = b
        return F.cross_entropy(m(x).view(-1, vocab), y.view(-1))

    return batches, loss_fn


def gpt_workload() -> Workload:
    vocab, ctx, batch = 2048, 64, 16
    torch.manual_seed(0)
    model = GPT(vocab=vocab, ctx=ctx)
    batches, loss_fn = token_batches(vocab, ctx, batch)
    n = sum(p.numel() for p in model.parameters())
    return Workload("transformer", model, batches, loss_fn,
                    f"GPT, 6 blocks, d_model 256, 8 heads, vocab {vocab}, untied head: {n / 1e6:.2f}M params in "
                    f"{len(list(model.parameters()))} tensors; batch {batch} x context {ctx} random tokens; AdamW")


def small_gpt_workload(d: int, layers: int, ctx: int, batch: int, vocab: int = 64) -> Workload:
    """A small GPT (4 heads), where the recorder's fixed cost per tensor dominates a step of a few milliseconds."""
    torch.manual_seed(0)
    model = GPT(vocab=vocab, ctx=ctx, d=d, layers=layers, heads=4)
    batches, loss_fn = token_batches(vocab, ctx, batch)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    return Workload("tiny", model, batches, loss_fn,
                    f"GPT, {layers} blocks, d_model {d}, 4 heads, vocab {vocab}: {n / 1e3:.1f}k params in "
                    f"{len(params)} tensors; batch {batch} x context {ctx}; AdamW")


def mlp_workload() -> Workload:
    width, depth, batch = 2048, 4, 8
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, width, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
               for _ in range(4)]

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    n = sum(p.numel() for p in model.parameters())
    return Workload("mlp", model, batches, loss_fn,
                    f"MLP, {depth} x Linear({width}, {width}) + ReLU, Linear({width}, 10): {n / 1e6:.2f}M params "
                    f"in {len(list(model.parameters()))} tensors; batch {batch}; AdamW")


def state_tensors(opt: torch.optim.Optimizer, p: torch.Tensor) -> list:
    return [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def full_copy(w: Workload) -> list:
    """What upd copies before a full-tensor step: param, grad and every state tensor (a clone on CPU)."""
    out = []
    for p in w.params:
        if p.grad is None:
            continue
        out.append(p.detach().clone())
        out.append(p.grad.detach().clone())
        out.extend(s.clone() for s in state_tensors(w.opt, p))
    return out


def payload_bytes(w: Workload) -> int:
    """Tensor bytes one full-tensor step records: param before and after, grad, optimizer state."""
    total = 0
    for p in w.params:
        total += 3 * p.numel() * p.element_size()
        total += sum(s.numel() * s.element_size() for s in state_tensors(w.opt, p))
    return total


# -- variants of the training loop ------------------------------------------------------------------------------
class Variant:
    name = ""
    label = ""

    def start(self, w: Workload, path: str) -> None:
        pass

    def before(self, w: Workload) -> None:
        pass

    def after(self, w: Workload) -> None:
        pass

    def stop(self) -> None:
        pass


class Plain(Variant):
    name, label = "plain", "plain training"


class Floor(Variant):
    name, label = "floor", "floor: 1 snapshot copy + 1 reduction per tensor"

    def start(self, w, path):
        self.snaps = [torch.empty_like(p) for p in w.params]

    def before(self, w):
        self.live = [p for p in w.params if p.grad is not None]
        self.grads = [p.grad for p in self.live]
        self.snap = self.snaps[: len(self.live)]
        torch._foreach_copy_(self.snap, [p.detach() for p in self.live])

    def after(self, w):
        params = [p.detach() for p in self.live]
        torch._foreach_sub_(self.snap, params)  # the snapshot becomes -update in place
        states = [s for p in self.live for s in state_tensors(w.opt, p) if s.is_floating_point() and s.dim() > 0]
        norms = [*torch._foreach_norm(params), *torch._foreach_norm(self.grads), *torch._foreach_norm(self.snap),
                 *torch._foreach_norm(states)]
        self.values = torch.stack(norms).tolist()  # one trip to the host


class Naive(Variant):
    """The seed question's loop (docs/background.md), as written there: clone each parameter whose name contains
    'weight' before the step; after it, per parameter (update.std() / before.std()).log10().item() (the
    summary_writer.add_scalar call left out), then clone again (the seed's last line; the clone before the next
    step replaces it)."""
    name, label = "naive", "seed's naive loop (clone, std().log10().item(), clone)"

    def start(self, w, path):
        self.named = [(n, p) for n, p in w.model.named_parameters() if p.requires_grad and "weight" in n]

    def before(self, w):
        for n, p in self.named:
            p.data_before_step = p.data.clone()

    def after(self, w):
        self.values = {}
        for n, p in self.named:
            update = p.data - p.data_before_step
            self.values[n] = (update.std() / p.data_before_step.std()).log10().item()
            p.data_before_step = p.data.clone()

    def stop(self):
        for n, p in self.named:
            del p.data_before_step


class ItemNorms(Variant):
    """What Lightning's grad_norm / Composer's norm logging do: per parameter p.grad.norm().item(), p.norm().item()."""
    name, label = "itemnorms", "per-param .item() norms logger"

    def before(self, w):
        self.values = {}
        for n, p in w.model.named_parameters():
            if p.grad is not None:
                self.values[n] = (p.grad.norm().item(), p.detach().norm().item())


class BareCopy(Variant):
    name, label = "clone", "bare clone of what full mode copies"

    def before(self, w):
        self.copies = full_copy(w)

    def after(self, w):
        self.copies.extend(p.detach().clone() for p in w.params if p.grad is not None)
        self.copies = None


class Recorded(Variant):
    def __init__(self, name, label, **options):
        self.name, self.label, self.options = name, label, options
        self.rec = None

    def start(self, w, path):
        self.path = path
        self.rec = upd.record(path, w.model, w.opt, overwrite=True, **self.options)

    def stop(self):
        self.rec.close()
        self.writer = type(self.rec._writer).__name__
        self.file_bytes = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        if self.rec.error is not None:
            raise RuntimeError(f"{self.name}: the recorder stopped: {self.rec.error!r}")


# -- timing helpers ---------------------------------------------------------------------------------------------
def median(xs):
    return statistics.median(xs) if xs else float("nan")


def quartiles(xs):
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def run_block(w: Workload, variant: Variant, path: str, steps: int, warmup: int) -> dict:
    gc.collect()
    variant.start(w, path)
    for _ in range(warmup):
        w.step(variant)
    times, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        w.step(variant)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    t = time.perf_counter()
    variant.stop()
    stop = time.perf_counter() - t
    extra = {"file_bytes": getattr(variant, "file_bytes", 0), "writer": getattr(variant, "writer", None)}
    if os.path.exists(path):
        os.remove(path)
    return {"median": median(times), "cpu": median(cpu), "times": times, "stop": stop, **extra}


def timed(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return median(out)


def floor_alone(w: Workload) -> float:
    """Seconds for the floor's work outside the loop: snapshot copy + one reduction over each tensor."""
    v = Floor()
    v.start(w, "")

    def once():
        v.before(w)
        v.after(w)
    once()
    return timed(once, 5)


# -- section 1: step overhead -----------------------------------------------------------------------------------
def section_overhead(w: Workload, variants: list, rounds: int, steps: int, warmup: int, workdir: str) -> dict:
    blocks = {v.name: [] for v in variants}
    floor_s, clone_s = [], []
    for r in range(rounds):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:  # rotated each round: no variant always follows another
            blocks[v.name].append(run_block(w, v, os.path.join(workdir, f"{w.name}-{v.name}.h5"), steps, warmup))
        floor_s.append(floor_alone(w))
        clone_s.append(timed(lambda: full_copy(w), 3))
        print(f"  {w.name} round {r + 1}/{rounds}, ms/step wall (process CPU): " + "  ".join(
            f"{v.name} {blocks[v.name][-1]['median'] * 1e3:.0f} ({blocks[v.name][-1]['cpu'] * 1e3:.0f})"
            for v in variants), flush=True)
    out = {"workload": w.name, "desc": w.desc, "numel": w.numel, "payload_bytes": payload_bytes(w),
           "rounds": rounds, "steps_per_block": steps, "warmup": warmup, "variants": {},
           "floor_alone_ms": median(floor_s) * 1e3, "clone_alone_ms": median(clone_s) * 1e3}
    plain = blocks["plain"]
    for v in variants:
        mine = blocks[v.name]
        x = {"label": v.label, "writer": mine[0]["writer"],
             "stop_ms": median([b["stop"] for b in mine]) * 1e3,
             "file_bytes_per_step": median([b["file_bytes"] for b in mine]) / (steps + warmup)}
        for clock in ("median", "cpu"):  # wall clock, training thread's CPU time
            key = "wall" if clock == "median" else "cpu"
            ratios = [b[clock] / p[clock] for b, p in zip(mine, plain)]
            x[f"{key}_ms"] = median([b[clock] for b in mine]) * 1e3
            x[f"{key}_ratio"] = median(ratios)
            x[f"{key}_q"] = quartiles(ratios)
            x[f"{key}_over_ms"] = median([(b[clock] - p[clock]) * 1e3 for b, p in zip(mine, plain)])
            x[f"{key}_per_round"] = ratios
        out["variants"][v.name] = x
    return out


def stats_agreement(w: Workload, workdir: str) -> float | None:
    """Largest |update_to_data(stats mode) - update_to_data(naive loop)| over the weights, on one shared step."""
    if not stats_mode_available():
        return None
    path = os.path.join(workdir, f"{w.name}-agree.h5")
    naive = Naive()
    naive.start(w, path)
    with upd.record(path, w.model, w.opt, every=None, stats_every=1, overwrite=True):
        w.step(naive)
    naive.stop()
    with upd.open_run(path) as run:
        df = run.stats()
    os.remove(path)
    got = dict(zip(df["param"], df["update_to_data"]))
    diffs = [abs(got[n] - v) for n, v in naive.values.items() if n in got and math.isfinite(v)]
    return max(diffs) if diffs else None


# -- section 2: full tensors: blocking, writer throughput, memory -----------------------------------------------
class StepOnly:
    """The MLP workload's optimizer step alone, on gradients computed once: the cheapest step there is, so the
    recorder's own cost dominates."""

    def __init__(self, w: Workload):
        self.w = w
        w.forward_backward()
        w.opt.step()  # creates the optimizer state

    def step(self, variant):
        variant.before(self.w)
        self.w.opt.step()
        variant.after(self.w)


class default_chunk_cache:
    """Diagnosis only: while active, h5py files open with h5py's default 1 MiB chunk cache whatever the caller
    asks (the recorder asks for 32 MiB), so the recorder can be timed with and without its cache setting."""

    def __enter__(self):
        self.original = original = h5py.File

        class File(original):
            def __init__(self, *args, **kwargs):
                kwargs.pop("rdcc_nbytes", None)
                super().__init__(*args, **kwargs)
        h5py.File = File

    def __exit__(self, *exc):
        h5py.File = self.original


def section_full(w: Workload, rounds: int, steps: int, workdir: str, diagnose: bool = False) -> dict:
    loop = StepOnly(w)
    nbytes = payload_bytes(w)
    kinds = ("plain", "clone", "full", "tofile") + (("full-1MiB-cache",) if diagnose else ())
    res = {k: [] for k in kinds}
    write_calls, blocked = [], []
    writer_name = None
    for r in range(rounds):
        shift = r % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            gc.collect()
            path = os.path.join(workdir, f"full-{kind}.bin")
            if kind == "tofile":
                res[kind].append(tofile_block(w, path, steps))
                continue
            variant = Recorded("full", "", every=1) if kind.startswith("full") else \
                {"plain": Plain(), "clone": BareCopy()}[kind]
            if kind == "full-1MiB-cache":
                with default_chunk_cache():
                    variant.start(w, path)
            else:
                variant.start(w, path)
            calls = []
            if kind == "full":
                writer = variant.rec._writer
                writer_name = type(writer).__name__
                if writer_name == "RunWriter":  # synchronous: time the write calls themselves
                    inner = writer.write

                    def timed_write(rec, inner=inner, calls=calls):
                        t = time.perf_counter()
                        inner(rec)
                        calls.append(time.perf_counter() - t)
                    writer.write = timed_write
            loop.step(variant)  # untimed: creates the datasets
            calls.clear()
            times = []
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                t = time.perf_counter()
                loop.step(variant)
                times.append(time.perf_counter() - t)
            if kind == "full":
                blocked.append(getattr(variant.rec._writer, "blocked_seconds", None))
            variant.stop()
            res[kind].append({"median": median(times), "wall": time.perf_counter() - t0,
                              "cpu": time.process_time() - c0})
            if os.path.exists(path):
                os.remove(path)
            if calls:
                write_calls.append(sum(calls))
        print(f"  full tensors round {r + 1}/{rounds}, ms per {steps} steps wall (process CPU): " + "  ".join(
            f"{k} {res[k][-1]['wall'] * 1e3:.0f} ({res[k][-1]['cpu'] * 1e3:.0f})" for k in kinds), flush=True)

    def over_rounds(fn):
        return median([fn(i) for i in range(rounds)])

    def rate(kind, clock, minus=None):
        """MB/s of payload: bytes / (block time - the `minus` block's time in the same round)."""
        return over_rounds(lambda i: nbytes * steps / max(1e-9, res[kind][i][clock] - (
            res[minus][i][clock] if minus else 0.0))) / MB

    out = {"desc": w.desc + "; the optimizer step alone, on fixed gradients", "payload_bytes": nbytes,
           "steps": steps, "rounds": rounds, "writer": writer_name,
           "plain_ms": median([x["median"] for x in res["plain"]]) * 1e3,
           "full_blocked_ms": over_rounds(lambda i: res["full"][i]["median"] - res["plain"][i]["median"]) * 1e3,
           "clone_ms": over_rounds(lambda i: res["clone"][i]["median"] - res["plain"][i]["median"]) * 1e3,
           "full_total_ms_per_step": over_rounds(
               lambda i: (res["full"][i]["wall"] - res["plain"][i]["wall"]) / steps) * 1e3,
           "write_call_mb_s": median([nbytes * steps / x for x in write_calls]) / MB if write_calls else None,
           "async_blocked_ms": (median(blocked) / steps * 1e3) if blocked and blocked[0] is not None else None}
    for clock in ("wall", "cpu"):
        out[f"writer_mb_s_{clock}"] = rate("full", clock, "clone")  # the copies are not the writer's work
        out[f"recorder_mb_s_{clock}"] = rate("full", clock, "plain")
        out[f"tofile_mb_s_{clock}"] = rate("tofile", clock)
        out[f"writer_vs_tofile_{clock}"] = out[f"writer_mb_s_{clock}"] / out[f"tofile_mb_s_{clock}"]
        out[f"recorder_vs_tofile_{clock}"] = out[f"recorder_mb_s_{clock}"] / out[f"tofile_mb_s_{clock}"]
        if diagnose:
            out[f"writer_1mib_mb_s_{clock}"] = rate("full-1MiB-cache", clock, "clone")
    if diagnose:
        out["blocked_1mib_ms"] = over_rounds(
            lambda i: res["full-1MiB-cache"][i]["median"] - res["plain"][i]["median"]) * 1e3
    out["per_round"] = res
    return out


def tofile_block(w: Workload, path: str, steps: int) -> dict:
    """numpy.tofile of the tensors one full-tensor step records, `steps` times, into one file."""
    arrays = []
    for p in w.params:
        arrays += [p.detach().numpy(), p.grad.numpy()]
        arrays += [s.numpy() for s in state_tensors(w.opt, p)]
        arrays.append(p.detach().numpy())
    t, c = time.perf_counter(), time.process_time()
    with open(path, "wb") as f:
        for _ in range(steps):
            for a in arrays:
                a.tofile(f)
    out = {"wall": time.perf_counter() - t, "cpu": time.process_time() - c}
    os.remove(path)
    return out


# -- peak memory, measured in fresh processes -------------------------------------------------------------------
# glibc keeps freed memory of a process for reuse, so in a long-running process the peak RSS of one phase hides
# behind what earlier phases left. Each memory figure therefore comes from a fresh Python process with
# MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB (large blocks are mmapped and returned at free: RSS follows live memory).
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def run_probe(spec: dict, threads: int) -> dict:
    env = dict(os.environ, **PROBE_ENV)
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(threads), "--probe", json.dumps(spec)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"probe {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe(spec: dict) -> dict:
    if spec["kind"] == "record":
        w = {"mlp": mlp_workload, "transformer": gpt_workload}[spec["workload"]]()
        loop = StepOnly(w)
        variant = {"plain": Plain(), "stats": Recorded("stats", "", every=None, stats_every=1),
                   "full": Recorded("full", "", every=1)}[spec["mode"]]
        with PeakRSS() as peak:
            variant.start(w, spec["path"])
            t, c = time.perf_counter(), time.process_time()
            for _ in range(spec["steps"]):
                loop.step(variant)
            variant.stop()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
        if os.path.exists(spec["path"]):
            os.remove(spec["path"])
        return {"peak": peak.delta, "reset": peak.reset, "wall": wall, "cpu": cpu, "payload": payload_bytes(w)}
    with PeakRSS() as peak:  # analyzer
        t = time.perf_counter()
        if spec["call"] == "ratios":
            with upd.open_run(spec["path"]) as run:
                rows, code = len(run.ratios()), None
        else:
            report = upd.verify(spec["path"])
            rows, code = len(report.checks), report.exit_code
        wall = time.perf_counter() - t
    return {"peak": peak.delta, "reset": peak.reset, "wall": wall, "rows": rows, "exit_code": code}


def section_memory(threads: int, steps: int, workdir: str, quick: bool) -> dict:
    """Peak RSS of recording `steps` optimizer steps of the MLP (step alone), each mode in a fresh process."""
    out = {}
    modes = ["full"] if quick else ["plain", "stats", "full"] if stats_mode_available() else ["plain", "full"]
    for mode in modes:
        out[mode] = run_probe({"kind": "record", "workload": "mlp", "mode": mode, "steps": steps,
                               "path": os.path.join(workdir, f"mem-{mode}.h5")}, threads)
        print(f"  memory, {mode}: peak RSS {out[mode]['peak'] / MB:.0f} MB above the start", flush=True)
    return {"steps": steps, "modes": out, "payload_bytes": out["full"]["payload"]}


def stats_table(steps: int, workdir: str) -> dict:
    """A statistics-only run of the transformer's optimizer step (fixed gradients): the file's growth per step
    from step steps/2 to steps (the table is allocated 64 steps at a time: use multiples of 128), the writer's time
    per step, and ratios() from the table."""
    w = gpt_workload()
    loop = StepOnly(w)
    path = os.path.join(workdir, "stats-table.h5")
    rec = upd.record(path, w.model, w.opt, every=None, stats_every=1, overwrite=True)
    writer, calls, sizes = rec._writer, [], {}
    if type(writer).__name__ == "RunWriter":
        inner = writer.write

        def timed_write(r):
            t = time.perf_counter()
            inner(r)
            calls.append(time.perf_counter() - t)
        writer.write = timed_write
    for i in range(1, steps + 1):
        loop.step(Plain())
        if i in (steps // 2, steps):
            sizes[i] = os.path.getsize(path)
    rec.close()
    t = time.perf_counter()
    with upd.open_run(path) as run:
        rows = len(run.ratios())
    out = {"steps": steps, "params": len(w.params),
           "bytes_per_step": (sizes[steps] - sizes[steps // 2]) / (steps - steps // 2),
           "write_ms": median(calls) * 1e3 if calls else None, "ratios_s": time.perf_counter() - t, "rows": rows}
    os.remove(path)
    return out


def stats_diagnosis() -> dict:
    """Where statistics mode's time goes, by process CPU time (medians of 7): upd's per-tensor statistics
    (upd.recorder.device_stats.tensor_stats) on one 2048 x 2048 float32 tensor against each of its reductions and against
    one L2 norm; then over every tensor of the reference transformer's step (param, grad, update, exp_avg,
    exp_avg_sq, and the 77 one-element step counters), split by size, against one batched _foreach_norm."""
    from upd.recorder.device_stats import tensor_stats, to_host

    def cpu_ms(fn, n=7):
        fn()
        xs = []
        for _ in range(n):
            c = time.process_time()
            fn()
            xs.append(time.process_time() - c)
        return median(xs) * 1e3

    x = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0)).reshape(-1)
    m = x.mean()
    one = {"tensor_stats (all 6 statistics)": lambda: tensor_stats(x),
           "sum (mean)": lambda: x.sum(dtype=torch.float32),
           "vector_norm(x - mean) (two-pass std)": lambda: torch.linalg.vector_norm(x - m, dtype=torch.float32),
           "vector_norm(x) (norm)": lambda: torch.linalg.vector_norm(x, dtype=torch.float32),
           "aminmax (absmax)": lambda: torch.aminmax(x),
           "count_nonzero (zero fraction)": lambda: torch.count_nonzero(x),
           "count_nonzero(x - x) (NaN/Inf count)": lambda: torch.count_nonzero(x - x),
           "dot(x, x) (sum of squares, one pass)": lambda: torch.dot(x, x)}
    single = {k: cpu_ms(f) for k, f in one.items()}
    w = gpt_workload()
    w.step(Plain())
    w.forward_backward()
    params = [p.detach() for p in w.params]
    tensors = params + [p.grad for p in w.params] + [p.detach().clone() for p in w.params] + [
        s for p in w.params for s in state_tensors(w.opt, p) if s.dim() > 0]
    scalars = [s for p in w.params for s in state_tensors(w.opt, p) if s.dim() == 0]
    small = [t for t in tensors if t.numel() < 65536]
    large = [t for t in tensors if t.numel() >= 65536]
    whole = {f"tensor_stats over all {len(tensors)} tensors + {len(scalars)} step counters, one host copy":
             lambda: to_host([tensor_stats(t) for t in tensors + scalars]),
             f"  of which the {len(large)} tensors >= 64k elements": lambda: to_host([tensor_stats(t) for t in large]),
             f"  of which the {len(small)} tensors < 64k elements": lambda: to_host([tensor_stats(t) for t in small]),
             f"  of which the {len(scalars)} step counters": lambda: to_host([tensor_stats(t) for t in scalars]),
             "one torch._foreach_norm over all tensors, one host copy":
             lambda: torch.stack(torch._foreach_norm(tensors)).tolist()}
    return {"single": single, "model": {k: cpu_ms(f) for k, f in whole.items()},
            "elements": sum(t.numel() for t in tensors)}


def report_stats_diagnosis(d: dict) -> str:
    norm = d["single"]["vector_norm(x) (norm)"]
    rows = [[k, f"{v:.2f}", f"{v / norm:.1f}"] for k, v in d["single"].items()]
    text = ("### where statistics mode's time goes (process CPU time, medians of 7)\n\nOne 2048 x 2048 float32 "
            "tensor:\n\n" + table(["operation", "ms", "x one norm"], rows))
    rows = [[k, f"{v:.1f}"] for k, v in d["model"].items()]
    text += (f"\n\nEvery tensor of one step of the reference transformer ({d['elements'] / 1e6:.1f}M elements):\n\n"
             + table(["operation", "ms"], rows))
    return text


# -- section 3: analyzer ----------------------------------------------------------------------------------------
def section_analyzer(w: Workload, steps: int, reps: int, threads: int, workdir: str) -> dict:
    """ratios() and verify() on a full-tensor run of `steps` and of 2 x `steps` steps, each call in a fresh
    process: time, and peak memory against file size (a streaming reader's peak does not grow with the file)."""
    paths = {}
    with upd.record(os.path.join(workdir, "analyzer-long.h5"), w.model, w.opt, every=1, overwrite=True) as long_rec, \
            upd.record(os.path.join(workdir, "analyzer-short.h5"), w.model, w.opt, every=1, overwrite=True) as short_rec:
        for i in range(2 * steps):
            if i == steps:
                short_rec.close()
            w.step(Plain())
    paths = {"short": short_rec.path, "long": long_rec.path}
    out = {"desc": w.desc, "step_bytes": payload_bytes(w), "steps": {"short": steps, "long": 2 * steps},
           "file_bytes": {k: os.path.getsize(p) for k, p in paths.items()}, "calls": {}}
    plan = ([("ratios", "short"), ("verify", "short")] if reps else []) + [
        x for r in range(reps) for x in ([("ratios", "long"), ("verify", "long")] if r % 2 == 0 else
                                         [("verify", "long"), ("ratios", "long")])] + (
        [] if reps else [("ratios", "long"), ("verify", "long")])
    for call, size in plan:
        got = run_probe({"kind": "analyzer", "call": call, "path": paths[size]}, threads)
        out["calls"].setdefault(f"{call}/{size}", []).append(got)
        print(f"  analyzer {call} on the {size} run ({out['file_bytes'][size] / MB:.0f} MB): {got['wall']:.2f} s, "
              f"peak RSS {got['peak'] / MB:.0f} MB", flush=True)
    for p in paths.values():
        os.remove(p)
    return out


# -- report -----------------------------------------------------------------------------------------------------
def table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%"


def report_overhead(o: dict) -> str:
    v = o["variants"]
    lines = [f"### {o['workload']}: {o['desc']}",
             f"{o['rounds']} rounds x {len(v)} variants, {o['steps_per_block']} timed steps per block after "
             f"{o['warmup']} untimed. Overhead = median over rounds of (block's median step / plain block's median "
             "step in the same round) - 1, by wall clock and by the process's CPU time (all threads: less sensitive "
             "to other work on the machine); [q1, q3] over rounds.", ""]
    rows = []
    for name, x in v.items():
        base = name == "plain"
        cells = [x["label"] + (f" [{x['writer']}]" if x.get("writer") else "")]
        for key in ("wall", "cpu"):
            q1, q3 = x[f"{key}_q"]
            cells += [f"{x[f'{key}_ms']:.1f}", "-" if base else f"{pct(x[f'{key}_ratio'])} [{pct(q1)}, {pct(q3)}]",
                      "-" if base else f"{x[f'{key}_over_ms']:+.1f}"]
        rows.append(cells)
    lines.append(table(["variant", "wall ms/step", "wall overhead [q1, q3]", "wall ms over plain",
                        "CPU ms/step", "CPU overhead [q1, q3]", "CPU ms over plain"], rows))
    lines.append("")
    lines.append(f"Outside the loop, same process: floor work alone {o['floor_alone_ms']:.1f} ms; bare clone of what "
                 f"full mode copies before the step ({o['payload_bytes'] * 0.8 / MB:.0f} MB) "
                 f"{o['clone_alone_ms']:.1f} ms.")
    if "stats" in v and "naive" in v:
        for key, clock in (("wall", "wall clock"), ("cpu", "CPU time")):
            s_over, n_over = v["stats"][f"{key}_ratio"] - 1, v["naive"][f"{key}_ratio"] - 1
            factor = f"{n_over / s_over:.1f}x" if s_over > 0 else "n/a (stats overhead <= 0)"
            lines.append(f"By {clock}: stats mode {s_over * 100:+.1f}%, naive loop {n_over * 100:+.1f}%: the naive "
                         f"loop costs {factor} what stats mode costs; stats mode costs "
                         f"{v['stats'][f'{key}_over_ms']:.1f} ms/step = "
                         f"{v['stats'][f'{key}_over_ms'] / o['floor_alone_ms']:.1f}x the floor work alone.")
    if "floor" in v and "naive" in v:
        for key, clock in (("wall", "wall clock"), ("cpu", "CPU time")):
            f_over, n_over = v["floor"][f"{key}_ratio"] - 1, v["naive"][f"{key}_ratio"] - 1
            lines.append(f"By {clock}: the floor costs {f_over * 100:+.1f}% in the loop; the naive loop costs "
                         + (f"{n_over / f_over:.1f}x the floor" if f_over > 0 else "n/a (floor overhead <= 0)")
                         + " (an implementation that snapshots and reduces every tensor cannot beat the naive loop "
                         "by more than this factor).")
    if o.get("agreement") is not None:
        lines.append(f"Stats mode vs the naive loop on one shared step: largest |difference| of update_to_data "
                     f"(log10) over the weights {o['agreement']:.1e}.")
    return "\n".join(lines)


def report_full(f: dict, mem: dict | None) -> str:
    rows = [
        ["plain optimizer step (no recorder)", f"{f['plain_ms']:.1f} ms", ""],
        ["training thread blocked per step: full mode's median step - plain", f"{f['full_blocked_ms']:.1f} ms", ""],
        ["bare clone of the same tensors: clone step - plain", f"{f['clone_ms']:.1f} ms", ""],
        ["blocked / bare clone", f"{f['full_blocked_ms'] / max(f['clone_ms'], 1e-9):.1f}x", ""],
        ["full mode per step incl. close() (drains an async writer) - plain", f"{f['full_total_ms_per_step']:.1f} ms",
         ""],
    ]
    for name, key in (("writer: payload / (recorded block incl. close - clone block)", "writer"),
                      ("recorder end to end: payload / (recorded block incl. close - plain block)", "recorder"),
                      ("numpy.tofile of the same bytes, same directory", "tofile")):
        rows.append([name, f"{f[f'{key}_mb_s_wall']:.0f} MB/s", f"{f[f'{key}_mb_s_cpu']:.0f} MB/s"])
    rows.append(["**writer / tofile** (target >= 0.70)", f"**{f['writer_vs_tofile_wall']:.2f}**",
                 f"**{f['writer_vs_tofile_cpu']:.2f}**"])
    rows.append(["recorder end to end / tofile", f"{f['recorder_vs_tofile_wall']:.2f}",
                 f"{f['recorder_vs_tofile_cpu']:.2f}"])
    if f.get("write_call_mb_s"):
        rows.append(["RunWriter.write() calls alone (timed around each call)", f"{f['write_call_mb_s']:.0f} MB/s"
                     f" = {f['write_call_mb_s'] / f['tofile_mb_s_wall']:.2f} x tofile", ""])
    if f.get("writer_1mib_mb_s_wall"):
        rows.append(["diagnosis: same recorder, h5py's default 1 MiB chunk cache instead of 32 MiB: writer",
                     f"{f['writer_1mib_mb_s_wall']:.0f} MB/s = {f['writer_1mib_mb_s_wall'] / f['tofile_mb_s_wall']:.2f}"
                     " x tofile", f"{f['writer_1mib_mb_s_cpu']:.0f} MB/s = "
                     f"{f['writer_1mib_mb_s_cpu'] / f['tofile_mb_s_cpu']:.2f} x tofile"])
        rows.append(["diagnosis: same, training thread blocked per step", f"{f['blocked_1mib_ms']:.1f} ms", ""])
    if f.get("async_blocked_ms") is not None:
        rows.append(["async writer: blocked_seconds per step (waiting for queue space)",
                     f"{f['async_blocked_ms']:.1f} ms", ""])
    head = (f"### full tensors at every step [{f['writer']}]: {f['desc']}\n"
            f"Payload {f['payload_bytes'] / MB:.0f} MB per step (param, grad, exp_avg, exp_avg_sq, step, "
            f"param_after). {f['steps']} timed steps per block after 1 untimed, {f['rounds']} rounds of plain / clone "
            "/ full / tofile (rotated), medians over rounds. MB/s by wall clock, and by process CPU time (user + "
            "system: the kernel's copy into the page cache counts) which other work on the machine disturbs less.\n\n")
    text = head + table(["measure", "wall clock", "CPU time"], rows)
    if mem:
        m = mem["modes"]
        rows = [[mode, f"{x['peak'] / MB:.0f} MB", f"{x['peak'] / mem['payload_bytes']:.2f}"]
                for mode, x in m.items()]
        text += (f"\n\nPeak memory recording {mem['steps']} steps (same step-only MLP loop), each in a fresh process "
                 "(see the note on the method):\n\n" + table(["mode", "peak RSS above the start",
                                                             "x one step's full payload"], rows))
    return text


def report_analyzer(a: dict) -> str:
    rows = []
    for call, label in (("ratios", "upd.open_run(p).ratios()"), ("verify", "upd.verify(p)")):
        for size in ("short", "long"):
            xs = a["calls"].get(f"{call}/{size}")
            if not xs:
                continue
            secs = median([x["wall"] for x in xs])
            peak = max(x["peak"] for x in xs)
            rows.append([label, f"{a['steps'][size]} steps, {a['file_bytes'][size] / MB:.0f} MB", f"{secs:.2f}",
                         f"{a['file_bytes'][size] / secs / MB:.0f}", f"{peak / MB:.0f} MB",
                         f"{peak / a['file_bytes'][size]:.2f}"])
    code = a["calls"]["verify/long"][0]["exit_code"]
    head = (f"### analyzer: full-tensor runs of the {a['desc'].split(':')[0]} ({a['step_bytes'] / MB:.0f} MB per "
            f"step); each call in a fresh process, file in the page cache; verify exit code {code}\n\n")
    text = head + table(["call", "run", "seconds", "MB/s of file", "peak RSS above start", "peak / file size"], rows)
    st = a.get("stats_table")
    if st:
        text += (f"\n\nStatistics-only run of the transformer ({st['params']} parameters, {st['steps']} steps): the file "
                 f"grows {st['bytes_per_step'] / 1e3:.1f} kB per step; RunWriter.write() takes "
                 + (f"{st['write_ms']:.1f} ms per step (median)" if st["write_ms"] is not None else "n/a (async)")
                 + f"; ratios() from the table ({st['rows']} rows) {st['ratios_s']:.2f} s.")
    return text


def verdicts(results: dict) -> list:
    out = []
    ref = results.get("overhead", {}).get("transformer")
    if ref and "stats" in ref["variants"]:
        v = ref["variants"]
        for key, clock in (("wall", "wall clock"), ("cpu", "process CPU time")):
            over = v["stats"][f"{key}_ratio"] - 1
            naive = v["naive"][f"{key}_ratio"] - 1
            factor = naive / over if over > 0 else float("inf")
            out.append(f"[{clock}] stats mode overhead on the reference transformer {over * 100:+.1f}% "
                       f"(target <= 3%): " + ("MET" if over <= 0.03 else "NOT MET"))
            out.append(f"[{clock}] naive loop overhead / stats mode overhead = {naive * 100:.1f}% / "
                       f"{over * 100:.1f}% = {factor:.1f}x (target >= 10x): " + ("MET" if factor >= 10 else "NOT MET"))
    elif ref:
        out.append("stats mode: not available in this upd (no stats_every= in upd.record)")
    full = results.get("full")
    if full:
        for clock in ("wall", "cpu"):
            r = full[f"writer_vs_tofile_{clock}"]
            out.append(f"[{'wall clock' if clock == 'wall' else 'process CPU time'}] writer throughput {r:.2f} x "
                       f"numpy.tofile (target >= 0.70): " + ("MET" if r >= 0.70 else "NOT MET"))
    return out


# -- main -------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps: a smoke run, well under a minute")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads for training (default 1: the other cores stay free for the writer "
                         "thread and the machine's other work)")
    ap.add_argument("--dir", default=None, help="where run files are written (default: the system temp dir)")
    ap.add_argument("--only", default="overhead,full,analyzer",
                    help="comma-separated sections: overhead, full, analyzer, statsdiag (the last also runs with "
                         "--diagnose)")
    ap.add_argument("--workloads", default=None,
                    help="for the overhead section: transformer,mlp (default; --quick: transformer)")
    ap.add_argument("--rounds", type=int, default=None, help="override the rounds of the overhead section")
    ap.add_argument("--diagnose", action="store_true",
                    help="also time the recorder with h5py's default chunk cache (full-tensor section) and break "
                         "statistics mode's time down (section statsdiag)")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: one memory measurement
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("error", upd.RecorderWarning)  # a recorder that stops would make the timings lie
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe))))
        return
    sections = set(args.only.split(","))

    workdir = tempfile.mkdtemp(prefix="upd-bench-", dir=args.dir)
    env = environment(args, workdir)
    print("# torch-upd overhead benchmark\n")
    print(table(["", ""], [[k, v] for k, v in env.items()]))
    print(f"\nstats mode (stats_every=): {'available' if stats_mode_available() else 'NOT available'}\n", flush=True)
    results = {"environment": env}
    quick = args.quick
    try:
        if "overhead" in sections:
            results["overhead"] = {}
            variants = [Plain()]
            if stats_mode_available():
                variants.append(Recorded("stats", "upd stats mode (every=None, stats_every=1)", every=None,
                                         stats_every=1))
            variants += [Floor(), Naive(), ItemNorms(), BareCopy(),
                         Recorded("full", "upd full tensors (every=1)", every=1)]
            plans = {"transformer": (gpt_workload, 2 if quick else 6, 1 if quick else 2),
                     "mlp": (mlp_workload, 2 if quick else 5, 2 if quick else 3)}
            for name in (args.workloads or ("transformer" if quick else "transformer,mlp")).split(","):
                make, rounds, steps = plans[name]
                w = make()
                print(f"## step overhead: {w.desc}", flush=True)
                o = section_overhead(w, variants, args.rounds or rounds, steps, 1, workdir)
                if name == "transformer":
                    o["agreement"] = stats_agreement(w, workdir)
                results["overhead"][name] = o
                print("\n" + report_overhead(o) + "\n", flush=True)
                del w
        if "full" in sections:
            w = mlp_workload()
            print(f"## full tensors: {w.desc}", flush=True)
            results["full"] = section_full(w, 2 if quick else 6, 2 if quick else 3, workdir, args.diagnose)
            del w
            results["memory"] = section_memory(args.threads, 2 if quick else 3, workdir, quick)
            print("\n" + report_full(results["full"], results["memory"]) + "\n", flush=True)
        if "analyzer" in sections:
            w = gpt_workload()
            print(f"## analyzer: {w.desc}", flush=True)
            results["analyzer"] = section_analyzer(w, 1 if quick else 3, 0 if quick else 2, args.threads, workdir)
            if stats_mode_available() and not quick:
                results["analyzer"]["stats_table"] = stats_table(128, workdir)
            print("\n" + report_analyzer(results["analyzer"]) + "\n", flush=True)
        if stats_mode_available() and ("statsdiag" in sections or (args.diagnose and "overhead" in sections)):
            results["stats_diagnosis"] = stats_diagnosis()
            print("\n" + report_stats_diagnosis(results["stats_diagnosis"]) + "\n", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    env["load_average_end"] = round(os.getloadavg()[0], 2)
    print("## targets\n")
    for line in verdicts(results):
        print("- " + line)
    print(f"\nload average (1 min) at start {env['load_average_start']}, at end {env['load_average_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
