"""Live trackers side by side: torch-upd's W&B and MLflow sinks against wandb.watch and the hand loop with TensorBoard.

    python -m benchmarks.sinks_overhead [--quick] [--workloads tiny,transformer] [--rounds N] [--json FILE]

Variants (AdamW, one training thread, the loss logged at every step where the variant logs anything):
- plain training;
- ``wandb.watch(model, log="all", log_freq=1)`` into an offline W&B run, with the ``wandb.log`` per step that
  commits its histograms;
- the seed's hand loop with TensorBoard: clone each weight before the step, then per weight
  ``(update.std() / before.std()).log10().item()`` and ``writer.add_scalar``;
- torch-upd's statistics at every step (``stats_every=1``, no sink), for reference;
- torch-upd with the W&B sink (offline) and with the MLflow sink (a temporary sqlite database), at every step, and
  the MLflow sink at every 10th step (``every=10``; the run file still gets every step).

Method: blocks of steps, round-robin in one process, the order rotated each round; a variant's overhead is its
block's time per step over the plain block's of the same round (median over rounds, [q1, q3]). The clocks: wall
time of the training loop's steps, and process CPU time (every thread of this process: the recorder's writer thread
included) until the variant's writing has caught up. W&B writes through a separate process (wandb-core), which
neither clock sees, for wandb.watch and the sink alike.

With a recorder that takes ``sinks=`` the sink variants are live. Without one, the sinks' own cost per step is
measured instead: the SinkSteps of a real recording of the same model, written in the recorder's batches of 64 on a
thread of their own (the writer thread's place), its CPU time per step.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import tempfile
import threading
import time
import warnings

import torch

import upd
from benchmarks.overhead import Workload, gpt_workload, median, quartiles, small_gpt_workload, table
from upd.sinks.export import sink_steps

LIVE_SINKS = "sinks" in inspect.signature(upd.Recorder.__init__).parameters
BATCH = 64  # steps per sink.write, as the recorder's writer thread hands them over


def tiny_workload() -> Workload:
    """A 3-block GPT, width 48 (the issue's tiny model)."""
    return small_gpt_workload(d=48, layers=3, ctx=32, batch=8)


class Variant:
    name = label = ""

    def start(self, w, folder):
        pass

    def before(self, w):
        pass

    def after(self, w, loss):
        pass

    def drain(self):
        pass

    def stop(self):
        pass


class Plain(Variant):
    name, label = "plain", "plain training"


class Watch(Variant):
    name, label = "watch", 'wandb.watch(model, log="all", log_freq=1), offline; wandb.log(loss) per step'

    def __init__(self, run):
        self.run = run

    def start(self, w, folder):
        import wandb
        wandb.watch(w.model, log="all", log_freq=1)

    def after(self, w, loss):
        self.run.log({"loss": loss.item()})

    def stop(self):
        import wandb
        wandb.unwatch()


class HandTensorBoard(Variant):
    name, label = "hand_tb", "hand loop + TensorBoard: clone, std ratio .log10().item(), add_scalar per weight"

    def start(self, w, folder):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(os.path.join(folder, "hand-tb"))
        self.named = [(n, p) for n, p in w.model.named_parameters() if p.requires_grad and "weight" in n]
        self.step = 0

    def before(self, w):
        self.before_step = [p.data.clone() for _, p in self.named]

    def after(self, w, loss):
        for (n, p), b in zip(self.named, self.before_step):
            self.writer.add_scalar(f"update_to_data/{n}", ((p.data - b).std() / b.std()).log10().item(), self.step)
        self.writer.add_scalar("loss", loss.item(), self.step)
        self.step += 1

    def drain(self):
        self.writer.flush()

    def stop(self):
        self.writer.close()


class Recorded(Variant):
    """upd.record with statistics at every step, the loss logged (a tensor: no sync), and `make_sink()`'s sink."""

    def __init__(self, name, label, make_sink=None):
        self.name, self.label, self.make_sink = name, label, make_sink

    def start(self, w, folder):
        sinks = [self.make_sink()] if self.make_sink is not None else []
        self.rec = upd.record(os.path.join(folder, f"{self.name}.h5"), w.model, w.opt, every=None, stats_every=1,
                              overwrite=True, **({"sinks": sinks} if sinks else {}))

    def before(self, w):
        self.rec.log(loss=self.loss)

    def drain(self):
        writer = self.rec._writer
        while getattr(writer, "records_written", self.rec.records) < self.rec.records and writer.error is None:
            time.sleep(0.0005)

    def stop(self):
        self.rec.close()
        if self.rec.error is not None:
            raise RuntimeError(f"{self.name}: the recorder stopped: {self.rec.error!r}")


def train_step(w: Workload, variant) -> None:
    w.opt.zero_grad(set_to_none=True)
    loss = w.loss_fn(w.model, w.batches[w.i % len(w.batches)])
    w.i += 1
    loss.backward()
    variant.loss = loss.detach()
    variant.before(w)
    w.opt.step()
    variant.after(w, variant.loss)


def run_block(w, variant, folder, steps, warmup) -> dict:
    gc.collect()
    variant.start(w, folder)
    for _ in range(warmup):
        train_step(w, variant)
    variant.drain()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        train_step(w, variant)
    wall = time.perf_counter() - t
    variant.drain()
    cpu = time.process_time() - c
    variant.stop()
    return {"wall": wall / steps, "cpu": cpu / steps}


def sink_cost(w: Workload, make_sink, folder: str, steps: int) -> float:
    """CPU seconds per step a sink spends in write(), on a thread of its own, fed the SinkSteps of a real
    recording of this model in batches of BATCH."""
    recording = Recorded("for-sinks", "")
    recording.start(w, folder)
    for _ in range(steps):
        train_step(w, recording)
    recording.stop()
    with upd.open_run(recording.rec.path) as run:
        all_steps = list(sink_steps(run.ratios(), run.scalars()))
    sink = make_sink()
    spent = []

    def write():
        start = time.thread_time()
        for i in range(0, len(all_steps), BATCH):
            sink.write(all_steps[i:i + BATCH])
        spent.append(time.thread_time() - start)
    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    sink.close()
    return spent[0] / len(all_steps)


def measure(w, variants, rounds, steps, warmup, folder) -> dict:
    blocks = {v.name: [] for v in variants}
    for r in range(rounds):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            blocks[v.name].append(run_block(w, v, folder, steps, warmup))
        print(f"  {w.name} round {r + 1}/{rounds}, ms/step CPU (wall): " + "  ".join(
            f"{v.name} {blocks[v.name][-1]['cpu'] * 1e3:.2f} ({blocks[v.name][-1]['wall'] * 1e3:.2f})"
            for v in variants), flush=True)
    out = {"workload": w.name, "desc": w.desc, "rounds": rounds, "steps": steps, "variants": {}}
    plain = blocks["plain"]
    for v in variants:
        x = {"label": v.label}
        for clock in ("cpu", "wall"):
            ratios = [b[clock] / p[clock] for b, p in zip(blocks[v.name], plain)]
            x[f"{clock}_ms"] = median([b[clock] for b in blocks[v.name]]) * 1e3
            x[f"{clock}_ratio"], x[f"{clock}_q"] = median(ratios), quartiles(ratios)
        out["variants"][v.name] = x
    return out


def pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def report(o: dict) -> str:
    lines = [f"### {o['workload']}: {o['desc']}", f"{o['rounds']} rounds x {o['steps']} steps", ""]
    rows = [[x["label"], f"{x['cpu_ms']:.2f}", f"{pct(x['cpu_ratio'])} [{pct(x['cpu_q'][0])}, {pct(x['cpu_q'][1])}]",
             f"{x['wall_ms']:.2f}", pct(x["wall_ratio"])] for x in o["variants"].values()]
    lines.append(table(["variant", "CPU ms/step", "CPU overhead [q1, q3]", "wall ms/step", "wall overhead"], rows))
    if "sink_cost_ms" in o:
        plain = o["variants"]["plain"]["cpu_ms"]
        for name, ms in o["sink_cost_ms"].items():
            lines.append(f"\n{name} sink, its own write() per step on the writer thread: {ms:.3f} ms "
                         f"= {ms / plain * 100:.1f}% of the plain step")
    v = o["variants"]
    watch = v.get("watch", {}).get("cpu_ratio")
    for name in ("upd_tb", "upd_wandb", "upd_mlflow", "upd_mlflow10"):
        if name in v and watch:
            s = v[name]["cpu_ratio"] - 1
            lines.append(f"\n{name}: overhead {s * 100:+.1f}% vs wandb.watch {(watch - 1) * 100:+.1f}% "
                         f"({s / (watch - 1):.2f} of it); hand loop + TensorBoard {pct(v['hand_tb']['cpu_ratio'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few rounds and steps (under 2 minutes)")
    parser.add_argument("--workloads", default="tiny,transformer")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    folder = tempfile.mkdtemp(prefix="upd-sinks-bench-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["WANDB_DIR"] = folder
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import wandb

    from upd.sinks.mlflow import MLflow
    from upd.sinks.tensorboard import TensorBoard
    from upd.sinks.wandb import WandB
    run = wandb.init(project="upd-bench", dir=folder)
    mlflow_uri = "sqlite:///" + os.path.join(folder, "mlflow.db")
    make = {"W&B": lambda: WandB(run), "MLflow": lambda: MLflow(tracking_uri=mlflow_uri, run_name="bench")}
    make["MLflow"]().close()  # the database is created before anything is timed
    results = []
    try:
        for name in args.workloads.split(","):
            w = tiny_workload() if name == "tiny" else gpt_workload()
            steps, warmup = (20, 3) if args.quick else (50, 5)
            if name != "tiny":
                steps = max(8, steps // 3)
            variants = [Plain(), Watch(run), HandTensorBoard(), Recorded("upd_stats", "upd statistics, no sink")]
            if LIVE_SINKS:
                variants += [Recorded("upd_tb", "upd statistics + TensorBoard sink (tensorboard=)",
                                      lambda: TensorBoard(os.path.join(folder, "upd-tb"))),
                             Recorded("upd_wandb", "upd statistics + W&B sink", make["W&B"]),
                             Recorded("upd_mlflow", "upd statistics + MLflow sink", make["MLflow"]),
                             Recorded("upd_mlflow10", "upd statistics + MLflow sink, every=10",
                                      lambda: MLflow(tracking_uri=mlflow_uri, run_name="bench", every=10))]
            print(f"{w.name}: {w.desc}", flush=True)
            o = measure(w, variants, rounds, steps, warmup, folder)
            if not LIVE_SINKS:
                o["sink_cost_ms"] = {label: sink_cost(w, f, folder, 64) * 1e3 for label, f in make.items()}
            results.append(o)
            print(report(o) + "\n", flush=True)
    finally:
        run.finish()
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"live_sinks": LIVE_SINKS, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
