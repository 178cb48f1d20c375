"""A recorded run sent to a sink after the fact, as the live recorder would have sent it.

    with upd.open_run("run.h5") as run:                 # one file or a distributed job
        export_run(run, upd.sinks.MLflow())              # or any sink: WandB(), TensorBoard(...), your own

The steps are the run's recorded steps: its ratios table (``run.ratios()``: every statistics and full-record step)
and its logged scalars (``run.scalars()``), one ``SinkStep`` per optimizer and step, in step order, handed to the sink
in batches as the recorder's writer thread hands them. A job's tables already hold the whole parameters, so a job is
sent once, as rank 0 sends it live.
"""
from __future__ import annotations

import importlib
import math
import os
from typing import Iterator

from . import mlflow as mlflow_sink, wandb as wandb_sink
from .base import LIVE_COLUMNS, SinkStep

BATCH_STEPS = 64  # steps per write(), as the recorder batches statistics rows
_KEYS = ("optimizer", "step")
_NOT_SCALARS = (*_KEYS, "wall_time")


def sink_steps(ratios, scalars) -> Iterator[SinkStep]:
    """A ratios table and a logged-scalars table as SinkSteps, ordered by step, then optimizer."""
    for frame, columns in ((ratios, ("optimizer", "param", "step")), (scalars, _KEYS)):
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise ValueError(f"not a run's table: missing column(s) {', '.join(missing)}")
    params: dict[tuple, dict] = {}
    if len(ratios):
        columns = [c for c in LIVE_COLUMNS if c in ratios.columns]
        for optimizer, param, step, *values in ratios[["optimizer", "param", "step", *columns]].itertuples(
                index=False):
            params.setdefault((int(optimizer), int(step)), {})[str(param)] = dict(zip(columns, values))
    logged: dict[tuple, dict] = {}
    walls: dict[tuple, float] = {}
    if len(scalars):
        names = [c for c in scalars.columns if c not in _NOT_SCALARS]
        wall_times = scalars["wall_time"].tolist() if "wall_time" in scalars.columns else [math.nan] * len(scalars)
        for optimizer, step, wall, values in zip(scalars["optimizer"].tolist(), scalars["step"].tolist(), wall_times,
                                                 scalars[names].to_numpy(dtype=float).tolist()):
            key = (int(optimizer), int(step))
            logged[key] = {n: v for n, v in zip(names, values) if not math.isnan(v)}
            if wall is not None and math.isfinite(wall):
                walls[key] = float(wall)
    for optimizer, step in sorted(params.keys() | logged.keys(), key=lambda k: (k[1], k[0])):
        key = (optimizer, step)
        yield SinkStep(optimizer=optimizer, step=step, wall_time=walls.get(key, 0.0),
                       params=params.get(key, {}), scalars=logged.get(key, {}))


def export_tables(ratios, scalars, sink, close: bool = True) -> int:
    """Send the tables' steps to `sink` in batches; close it at the end when `close`. Returns the steps sent."""
    sent = 0
    batch: list[SinkStep] = []
    try:
        for step in sink_steps(ratios, scalars):
            batch.append(step)
            if len(batch) == BATCH_STEPS:
                sink.write(batch)
                sent, batch = sent + len(batch), []
        if batch:
            sink.write(batch)
            sent += len(batch)
    finally:
        if close:
            sink.close()
    return sent


def export_run(run, sink, close: bool = True) -> int:
    """Send an open run's (or job's) recorded steps to `sink`; see ``export_tables``."""
    return export_tables(run.ratios(), run.scalars(), sink, close=close)


# -- `upd analyze RUN --wandb / --mlflow`: a new tracker run per export -------------------------------------------
TRACKERS = ("wandb", "mlflow")


def tracker_problem(tracker: str) -> str | None:
    """Why a run cannot be exported to `tracker` here (its package is missing or broken), or None: checked before
    the run is read."""
    hint = {"wandb": wandb_sink.INSTALL_HINT, "mlflow": mlflow_sink.INSTALL_HINT}[tracker]
    try:
        importlib.import_module(tracker)
    except ImportError as exc:
        return f"--{tracker} needs the {tracker} package, which is not installed or not usable ({exc}): {hint}"
    return None


def export_to_tracker(tracker: str, ratios, scalars, run_name: str) -> str:
    """Send the tables to a new run of `tracker` (named `run_name`: W&B's project, mode and the rest from its
    WANDB_* variables; MLflow's tracking URI as the sink finds it) and say in one line where they went."""
    if tracker == "wandb":
        sink = wandb_sink.WandB(name=run_name, job_type="upd-export")
        where = sink.run.url or f"offline run {sink.run.id} in {os.path.dirname(sink.run.dir)}"  # what `wandb sync` takes
        steps = export_tables(ratios, scalars, sink)
        return f"W&B: {steps} steps in {where}"
    sink = mlflow_sink.MLflow(run_name=run_name)
    steps = export_tables(ratios, scalars, sink)
    return f"MLflow: {steps} steps in run {sink.run_id} at {sink.tracking_uri}"
