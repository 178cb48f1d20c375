"""Does recording cost more when the optimizer step (or the model) is compiled? Side by side, in one process.

    python -m benchmarks.compile_overhead [--rounds 5] [--steps 60]

A 6-layer, 256-wide MLP trained with Adam. Four loops run in blocks of `--steps` steps, round-robin, the order
rotated each round: eager and `torch.compile(optimizer.step)`, each unrecorded and recorded with
``upd.record(path, model, opt, every=50, stats_every=1)``. Each block's median step time is divided by the
unrecorded median of the same mode in the same round; the table shows the median of those ratios over rounds. The
recorder's hooks are excluded from dynamo tracing, so the recorded/unrecorded ratio should be no larger compiled
than eager.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn

import upd


def make(compiled: bool):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = torch.compile(opt.step) if compiled else opt.step
    return model, opt, step


def block(model, opt, step, steps: int) -> float:
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loops = {mode: make(mode == "compiled") for mode in ("eager", "compiled")}
    for model, opt, step in loops.values():
        block(model, opt, step, 10)  # warm-up: compilation and the optimizer's state
    ratios = {"eager": [], "compiled": []}
    medians = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            variants = [(m, rec) for m in ("eager", "compiled") for rec in (False, True)]
            variants = variants[r % len(variants):] + variants[:r % len(variants)]
            got = {}
            for mode, recorded in variants:
                model, opt, step = loops[mode]
                if recorded:
                    path = os.path.join(folder, f"{mode}{r}.h5")
                    with upd.record(path, model, opt, every=50, stats_every=1):
                        got[mode, True] = block(model, opt, step, args.steps)
                else:
                    got[mode, False] = block(model, opt, step, args.steps)
            for mode in ratios:
                ratios[mode].append(got[mode, True] / got[mode, False])
                medians[mode].append(got[mode, False])
    print(f"6x256 MLP, Adam, {args.rounds} rounds x {args.steps} steps, 1 thread, load average "
          f"{os.getloadavg()[0]:.2f}")
    print("recorded / unrecorded median step time, median over rounds [min, max]:")
    for mode in ratios:
        print(f"  {mode:>8}: {statistics.median(ratios[mode]):.3f} [{min(ratios[mode]):.3f}, {max(ratios[mode]):.3f}]"
              f"; unrecorded step {1e3 * statistics.median(medians[mode]):.2f} ms")


if __name__ == "__main__":
    main()
