"""The sink protocol: where a recording's statistics go live, beside the run file.

A sink is any object with ``write(steps)`` and ``close()``:

    class PrintSink:
        def write(self, steps):                      # a batch of SinkStep, in step order
            for s in steps:
                print(s.step, s.scalars.get("loss"), s.params["fc1.weight"]["update_to_data"])
        def close(self):
            pass

    upd.record("run.h5", model, optimizer, sinks=[PrintSink()])

The recorder calls ``write`` off the training thread (on the run file's writer thread), with values already on the
host: a sink adds no device synchronisation and never delays a step. Each ``SinkStep`` is one optimizer step that
had statistics (``stats_every=``) or logged scalars; a step's statistics and its scalars arrive together, in one
``SinkStep``. In a distributed job only one process (rank 0) calls its sinks, with the whole parameters' values;
the other ranks' sinks are closed unused. A sink that raises is warned about once and dropped: training and the
run file go on. ``close()`` is called once, when the recorder closes (a sink the user made from an object of their
own, e.g. a ``SummaryWriter``, flushes it and leaves it open).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, runtime_checkable

from ..alert_rules import ALERT_WORDS  # its keys: every alert kind
# LIVE_COLUMNS: the statistics a live sink shows per parameter, each as "<column>/<param>", in this order.
from ..statistics import LIVE_COLUMNS
# Logged scalars (rec.log, the recorder's total gradient norms and clipping) are "scalars/<name>".
SCALARS_SECTION = "scalars"
# Live alerts: at each checked step, how many parameters each rule fired for, "alerts/<kind>" (0 when none did).
ALERTS_SECTION = "alerts"


@dataclass(frozen=True)
class SinkStep:
    """One recorded step, on the host.

    ``optimizer``: the optimizer's index in the recording (0 for the first); ``step``: its step count, the run
    file's ``step`` (0 for the first step); ``params``: parameter name -> {statistic column: value} (empty when the
    step had logged scalars only); ``scalars``: logged name -> value (loss, lr, total gradient norms); ``alerts``:
    with ``upd.record(..., alerts=...)``, the ``upd.alert_rules.Alert``s of a statistics step (empty: none fired),
    None when the step was not checked. ``metrics`` shows their counts as "alerts/<kind>".
    """
    optimizer: int
    step: int
    wall_time: float
    params: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    scalars: Mapping[str, float] = field(default_factory=dict)
    alerts: Sequence | None = None


@runtime_checkable
class Sink(Protocol):
    def write(self, steps: Sequence[SinkStep]) -> None: ...

    def close(self) -> None: ...


def finite(value, limit: float = math.inf) -> float | None:
    """value as a float when it is a finite number no larger than ``limit`` in magnitude, else None."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and abs(v) <= limit else None


def optimizer_prefix(optimizer: int) -> str:
    """The prefix of optimizer k's names in live tags: none for the first, "opt<k>:" for the others."""
    return f"opt{int(optimizer)}:" if int(optimizer) else ""


def metrics(step: SinkStep, columns: Sequence[str] = LIVE_COLUMNS, limit: float = math.inf) -> dict[str, float]:
    """A step's values as flat tags: "<column>/<prefix><param>" and "scalars/<prefix><name>", finite values only.

    Every sink names what it writes this way, so that the same quantity has the same name in TensorBoard, W&B and
    MLflow, live or exported from a finished run.
    """
    prefix = optimizer_prefix(step.optimizer)
    out: dict[str, float] = {}
    for name, values in step.params.items():
        for column in columns:
            v = finite(values.get(column), limit)
            if v is not None:
                out[f"{column}/{prefix}{name}"] = v
    for name, raw in step.scalars.items():
        v = finite(raw, limit)
        if v is not None:
            out[f"{SCALARS_SECTION}/{prefix}{name}"] = v
    if step.alerts is not None:
        counts = dict.fromkeys(ALERT_WORDS, 0)
        for alert in step.alerts:
            counts[alert.kind] = counts.get(alert.kind, 0) + 1
        for kind, count in counts.items():
            out[f"{ALERTS_SECTION}/{prefix}{kind}"] = float(count)
    return out
