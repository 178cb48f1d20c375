"""What the live alerts cost beyond statistics mode: ``upd.record(..., stats_every=1)`` with and without
``alerts=True``, side by side.

    python -m benchmarks.alerts_overhead [--quick] [--workloads tiny,transformer] [--rounds N] [--json FILE]

Variants (AdamW, one training thread, the loss logged at every step): plain training; torch-upd's statistics at
every step; the same with ``alerts=True``. Method as benchmarks/sinks_overhead.py: blocks of steps round-robin in
one process, the order rotated each round (so the two recorded variants alternate), each block's time per step over
the plain block's of the same round (median over rounds, [q1, q3]). The clocks: wall time of the training loop's
steps and process CPU time (the writer thread, where the alerts are checked, included) until everything queued is
written and checked (``AsyncRunWriter.sync``). The figure to read: ``alerts_vs_stats``, the alerts variant's CPU
time per step over the statistics variant's of the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings

import numpy as np
import torch

import upd
from upd.alert_rules import AlertRules, is_weight
from upd.recorder.alerts import LiveAlerts
from benchmarks.overhead import gpt_workload
from benchmarks.sinks_overhead import Plain, Recorded, measure, pct, report, tiny_workload


class RecordedStats(Recorded):
    """Statistics at every step, with or without the live alerts; drained until the writer thread caught up."""

    def __init__(self, name, label, alerts):
        super().__init__(name, label)
        self.alerts = alerts

    def start(self, w, folder):
        self.rec = upd.record(os.path.join(folder, f"{self.name}.h5"), w.model, w.opt, every=None, stats_every=1,
                              overwrite=True, alerts=self.alerts)

    def drain(self):
        self.rec._writer.sync()


def check_cost(folder: str) -> float:
    """CPU seconds per step of the live check itself, on the statistics the alerts variant recorded: the rules over
    each step's columns, as the writer thread runs them (events stored nowhere)."""
    with upd.open_run(os.path.join(folder, "upd_alerts.h5")) as run:
        stats = run.stats()
        shapes = {r.param: tuple(r.shape) for r in run.params().itertuples()}
    names = sorted(shapes)
    weights = np.array([is_weight(shapes[n]) for n in names])
    steps = []
    for step, rows in stats.groupby("step"):
        rows = rows.set_index("param").reindex(names)
        steps.append((int(step), {c: rows[c].to_numpy(dtype=np.float64) for c in rows.columns
                                  if c not in ("optimizer", "step")}))
    live = LiveAlerts(AlertRules())
    start = time.thread_time()
    for step, columns in steps:
        live.check(0, step, 0.0, names, columns, weights)
    return (time.thread_time() - start) / len(steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few rounds and steps (under 2 minutes)")
    parser.add_argument("--workloads", default="tiny,transformer")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 9)
    folder = tempfile.mkdtemp(prefix="upd-alerts-bench-")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    results = []
    try:
        for name in args.workloads.split(","):
            w = tiny_workload() if name == "tiny" else gpt_workload()
            steps, warmup = (40, 5) if args.quick else (80, 5)
            if name != "tiny":
                steps = max(8, steps // 4)
            variants = [Plain(), RecordedStats("upd_stats", "upd statistics every step", False),
                        RecordedStats("upd_alerts", "upd statistics every step + alerts=True", True)]
            print(f"{w.name}: {w.desc}", flush=True)
            o = measure(w, variants, rounds, steps, warmup, folder)
            print(report(o), flush=True)
            stats, alerts = o["variants"]["upd_stats"], o["variants"]["upd_alerts"]
            # Per round: the alerts block over the statistics block (both over the same round's plain block).
            ratio = alerts["cpu_ms"] / stats["cpu_ms"]
            o["alerts_vs_stats_cpu"] = ratio
            print(f"\nalerts vs statistics alone, CPU time per step (medians): {pct(ratio)}\n", flush=True)
            o["check_us_per_step"] = check_cost(folder) * 1e6
            print(f"the alert check alone (LiveAlerts on the recorded statistics, one step at a time): "
                  f"{o['check_us_per_step']:.0f} us CPU per step, {o['check_us_per_step'] / 1e3 / stats['cpu_ms'] * 100:.2f}% "
                  f"of the statistics step\n", flush=True)
            results.append(o)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
