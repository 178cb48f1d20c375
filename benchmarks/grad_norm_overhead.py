"""What the total gradient norms cost (the clipping check): recording with them against recording without them.

    python -m benchmarks.grad_norm_overhead [--rounds 5] [--steps 40]

A 6-layer, 256-wide MLP (13 tensors) trained with AdamW and clip_grad_norm_, recorded with
``upd.record(path, model, opt, every=None, stats_every=1)`` (every step measured). Three loops run in blocks of
`--steps` steps, round-robin: unrecorded, recorded, and recorded with the two norm measurements switched off. Each
block's median step time is divided by the unrecorded median of the same round; the table shows the median ratio
over rounds. The norms' cost is the difference between the two recorded rows. At these (lean) statistics steps the
norm the step saw costs no pass of its own (the statistics' gradient norms give it): what is switched off is the
backward pass's norm. Then each way of taking that norm is timed on its own: ``total_norm`` (one norm per tensor)
and ``TotalNorm`` (small tensors copied into one reused float64 buffer and reduced with one norm), the recorder's.
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
from upd.recorder.grad_norms import TotalNorm, total_norm
from upd.recorder.recorder import Recorder
from upd.recorder.track import OptimizerTrack


def make():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def block(model, opt, rec, steps: int) -> float:
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if rec is not None:
            rec.log(loss=loss)
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    ratios = {"recorded": [], "recorded without the norms": []}
    originals = (Recorder._measure_backward_norms, OptimizerTrack._measure_step_norms)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            model, opt = make()
            baseline = block(model, opt, None, args.steps)
            for label in (list(ratios) if r % 2 == 0 else list(ratios)[::-1]):  # alternate which runs first
                model, opt = make()
                if label != "recorded":
                    Recorder._measure_backward_norms = lambda self: None
                    OptimizerTrack._measure_step_norms = lambda self: None
                try:
                    with upd.record(os.path.join(tmp, f"{r}-{list(ratios).index(label)}.h5"), model, opt, every=None,
                                    stats_every=1) as rec:
                        ratios[label].append(block(model, opt, rec, args.steps) / baseline)
                finally:
                    Recorder._measure_backward_norms, OptimizerTrack._measure_step_norms = originals
    print(f"{'':32} median step time / unrecorded (over {args.rounds} rounds of {args.steps} steps)")
    for label, values in ratios.items():
        print(f"{label:32} {statistics.median(values):.3f}x")
    # The backward pass's norm alone, timed directly, both ways; one per recorded step.
    model, opt = make()
    step_time = block(model, opt, None, args.steps)
    grads = [p.grad for p in model.parameters()]
    for label, norm in (("total_norm", total_norm), ("TotalNorm", TotalNorm())):
        calls = []
        for _ in range(200):
            start = time.perf_counter()
            norm(grads)
            calls.append(time.perf_counter() - start)
        norm_time = statistics.median(calls)
        print(f"one {label} over the {len(grads)} gradients: {norm_time * 1e6:.0f} us = "
              f"{norm_time / step_time:.1%} of the unrecorded step ({step_time * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
