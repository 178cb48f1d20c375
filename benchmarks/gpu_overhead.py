"""Statistics at every step on a GPU: plain training, upd's statistics, and the hand-written loop, side by side.

    python -m benchmarks.gpu_overhead [--rounds N] [--steps N] [--json FILE]

Runs as is where torch sees a CUDA device, and exits with a message (status 0) where it does not. What it shows
and why (docs/performance.md, "On a GPU"): the hand loop's ``.item()`` per weight is a host synchronisation, so each
one drains the GPU's queue and the Python thread waits for it: ~40 per step on the reference transformer.
``upd.record(..., stats_every=1)`` launches every reduction asynchronously and copies all results to the host once
per step, so on a GPU its cost should be the kernels' (a few memory passes per tensor, far below a step's matmuls)
plus one synchronisation, against the hand loop's dozens.

Workloads: the reference GPT-style transformer of benchmarks/overhead.py (5.8M parameters, 77 tensors) at a GPU
batch, and a larger one (d_model 1024, 12 blocks, ~150M parameters). Variants: plain, hand loop (clone each weight
before the step, ``(update.std() / before.std()).log10().item()`` per weight after it), upd statistics (default
lean set), upd statistics with the full set at every step. Each block's time is the wall clock of its steps,
ended by ``torch.cuda.synchronize()``; ratios to the plain block of the same round, medians over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

import upd
from benchmarks.overhead import GPT


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class Workload:
    def __init__(self, name, d, layers, heads, vocab, ctx, batch, device):
        torch.manual_seed(0)
        self.name = name
        self.model = GPT(vocab=vocab, ctx=ctx, d=d, layers=layers, heads=heads).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        gen = torch.Generator(device="cpu").manual_seed(1)
        self.batches = [(torch.randint(0, vocab, (batch, ctx), generator=gen).to(device),
                         torch.randint(0, vocab, (batch, ctx), generator=gen).to(device)) for _ in range(4)]
        self.vocab = vocab
        self.i = 0
        n = sum(p.numel() for p in self.model.parameters())
        self.desc = (f"GPT d_model {d}, {layers} blocks, vocab {vocab}, batch {batch} x {ctx}: {n / 1e6:.1f}M params "
                     f"in {len(list(self.model.parameters()))} tensors; AdamW")

    def step(self, before, after):
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(x).view(-1, self.vocab), y.view(-1)).backward()
        before()
        self.opt.step()
        after()


def nothing():
    pass


def run_block(w: Workload, variant: str, path: str, steps: int) -> float:
    rec = None
    hooks = (nothing, nothing)
    if variant == "hand":
        named = [p for n, p in w.model.named_parameters() if "weight" in n]
        held = {}

        def clone_weights():
            held["b"] = [p.data.clone() for p in named]

        def log_ratios():
            for p, b in zip(named, held["b"]):
                ((p.data - b).std() / b.std()).log10().item()  # a host synchronisation per weight
        hooks = (clone_weights, log_ratios)
    elif variant.startswith("stats"):
        extra = {"full_stats_every": 1} if variant == "stats_full" else {}
        rec = upd.record(path, w.model, w.opt, every=None, stats_every=1, overwrite=True, **extra)
    before, after = hooks
    for _ in range(2):
        w.step(before, after)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        w.step(before, after)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - t) / steps
    if rec is not None:
        rec.close()
        if rec.error is not None:
            raise RuntimeError(f"the recorder stopped: {rec.error!r}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.gpu_overhead: no CUDA device visible to torch (torch.cuda.is_available() is False); "
              "nothing to measure here. Run it on a machine with a GPU.")
        sys.exit(0)
    warnings.simplefilter("error", upd.RecorderWarning)
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    workloads = [("reference", dict(d=256, layers=6, heads=8, vocab=2048, ctx=64, batch=64)),
                 ("large", dict(d=1024, layers=12, heads=16, vocab=32768, ctx=256, batch=16))]
    variants = ["plain", "hand", "stats", "stats_full"]
    workdir = tempfile.mkdtemp(prefix="upd-gpu-bench-")
    results = {}
    try:
        for name, shape in workloads:
            w = Workload(name, device=device, **shape)
            print(f"## {w.desc}", flush=True)
            times = {v: [] for v in variants}
            for r in range(args.rounds):
                shift = r % len(variants)
                for v in variants[shift:] + variants[:shift]:
                    times[v].append(run_block(w, v, os.path.join(workdir, f"{name}-{v}.h5"), args.steps))
                print(f"  round {r + 1}: " + "  ".join(f"{v} {times[v][-1] * 1e3:.2f} ms" for v in variants),
                      flush=True)
            rows = {}
            for v in variants:
                ratios = [a / b for a, b in zip(times[v], times["plain"])]
                rows[v] = {"ms": median(times[v]) * 1e3, "ratio": median(ratios), "per_round": ratios}
            results[name] = {"desc": w.desc, "variants": rows}
            print("\n| variant | ms/step | overhead |\n|---|---|---|")
            for v, x in rows.items():
                print(f"| {v} | {x['ms']:.2f} | {(x['ratio'] - 1) * 100:+.1f}% |")
            print(flush=True)
            del w
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
