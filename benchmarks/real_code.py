"""Statistics at every step on training code we did not write: what a user of a small model sees.

    python -m benchmarks.real_code [--rounds N] [--workloads gpt2,lightning]

Two small real setups, each trained in a fresh process with and without ``stats_every=1`` (exact statistics, the
default set), the processes alternating, the order rotated each round:

* ``gpt2``: a Hugging Face ``GPT2LMHeadModel`` built from a config (2 layers, width 32, vocabulary 256: 28
  parameter tensors), AdamW, 300 steps of random tokens, the user's own loop, ``upd.record(...)`` around it;
* ``lightning``: a Lightning ``Trainer`` fitting a small MLP (2 hidden layers of 64) for 600 steps, with
  ``upd.integrations.lightning.UpdCallback(every=None, stats_every=1)`` as its only change.

Each child measures its training alone (after imports and model building; the recorder's file creation and close
included), by wall clock and by process CPU time, and prints JSON. Reported: the median over rounds of each
variant's time per step and of the recorded / plain ratio taken per round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

CHILD = {
    "gpt2": textwrap.dedent("""
        import json, sys, time, torch, upd
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.set_num_threads(1); torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 256, (8, 4, 32))
        steps, path = 300, sys.argv[1]

        def train():
            for i in range(steps):
                batch = tokens[i % len(tokens)]
                loss = model(input_ids=batch, labels=batch).loss
                opt.zero_grad(); loss.backward(); opt.step()
        for i in range(20):  # warm-up: the first steps allocate the optimizer state
            batch = tokens[i % len(tokens)]
            model(input_ids=batch, labels=batch).loss.backward(); opt.step(); opt.zero_grad()
        wall, cpu = time.perf_counter(), time.process_time()
        if path == "-":
            train()
        else:
            with upd.record(path, model, opt, every=None, stats_every=1, overwrite=True):
                train()
        print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "steps": steps,
                          "tensors": len(list(model.parameters()))}))
    """),
    "lightning": textwrap.dedent("""
        import json, os, sys, time, warnings, torch
        import lightning.pytorch as pl
        from torch import nn
        from upd.integrations.lightning import UpdCallback
        warnings.filterwarnings("ignore")
        torch.set_num_threads(1); torch.manual_seed(0)

        class MLP(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

            def training_step(self, batch, _):
                x, y = batch
                return nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)

        data = torch.utils.data.TensorDataset(torch.randn(600 * 16, 32), torch.randn(600 * 16, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=16)
        steps, path = 600, sys.argv[1]
        callbacks = [] if path == "-" else [UpdCallback(path, every=None, stats_every=1)]
        trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", devices=1, callbacks=callbacks,
                             default_root_dir=os.path.dirname(path) if path != "-" else None)
        model = MLP()
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.fit(model, loader)
        print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "steps": steps,
                          "tensors": len(list(model.parameters()))}))
    """),
}


def run_child(workload: str, path: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD[workload], path], capture_output=True, text=True,
                          timeout=900)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or not last.startswith("{"):
        raise SystemExit(f"{workload} child failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="gpt2,lightning")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    print(f"load average (1 min) at start {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="upd-real-code-") as folder:
        for workload in workloads:
            results = {"plain": [], "stats": []}
            for r in range(args.rounds):
                order = ["plain", "stats"] if r % 2 == 0 else ["stats", "plain"]
                for variant in order:
                    path = "-" if variant == "plain" else os.path.join(folder, f"{workload}-{r}.h5")
                    results[variant].append(run_child(workload, path))
                plain, stats = results["plain"][-1], results["stats"][-1]
                print(f"  {workload} round {r + 1}/{args.rounds}: plain {plain['wall']:.2f} s wall "
                      f"{plain['cpu']:.2f} s CPU, stats {stats['wall']:.2f} s wall {stats['cpu']:.2f} s CPU")
            steps, tensors = results["plain"][0]["steps"], results["plain"][0]["tensors"]
            print(f"\n### {workload}: {steps} steps, {tensors} parameter tensors, median of {args.rounds} rounds\n")
            print("| variant | wall ms/step | CPU ms/step |\n|---|---|---|")
            for variant in ("plain", "stats"):
                wall = statistics.median(x["wall"] for x in results[variant]) / steps * 1e3
                cpu = statistics.median(x["cpu"] for x in results[variant]) / steps * 1e3
                print(f"| {variant} | {wall:.2f} | {cpu:.2f} |")
            for clock in ("wall", "cpu"):
                ratios = [s[clock] / p[clock] for p, s in zip(results["plain"], results["stats"])]
                extra = [(s[clock] - p[clock]) / steps * 1e3 for p, s in zip(results["plain"], results["stats"])]
                print(f"\nstats / plain by {clock}: {statistics.median(ratios):.2f}x "
                      f"(+{statistics.median(extra):.2f} ms per step; rounds "
                      f"{', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"\nload average (1 min) at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
