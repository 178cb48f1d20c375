"""How a recording reaches its sinks: ``SinkStep``s made from the records the run file's writer thread has written,
handed to each sink on that thread, each sink guarded.

The recorder makes one ``SinkFeed`` for the sinks of the process that writes live values (``sink_role``: one
process, the writing rank of replicated training, rank 0 of a job whose ranks each hold a part). Where that process's
own statistics are the whole parameters' it gives ``records_written`` to the run file's writer as its ``on_written``
hook; rank 0 of a split job instead hands over the job's combined statistics, with its scalar rows, through
``AsyncRunWriter.run_later(partial(feed.deliver, steps))``. Nothing here runs on the training thread but ``close``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from ..runfile.record import Record
from .base import Sink, SinkStep

# Who writes live values in a recording (``sink_role``): this process its own statistics; rank 0 the job's
# statistics combined over the ranks (each holds a part); nobody here.
SINKS_OWN, SINKS_JOB, SINKS_NONE = "own", "job", "none"


def sink_problem(sink) -> str | None:
    """Why `sink` cannot be a sink (``upd.sinks.base.Sink``: callable ``write`` and ``close``), or None."""
    missing = [name for name in ("write", "close") if not callable(getattr(sink, name, None))]
    if missing:
        return f"a {type(sink).__name__} has no {' or '.join(missing)}() (a sink has write(steps) and close())"
    return None


def sink_steps(records: Iterable[Record]) -> list[SinkStep]:
    """The SinkSteps of written records, in the order written: one per optimizer step with statistics or logged
    scalars, a step's statistics and its scalars together (a step's scalar rows logged twice merged, as readers
    merge them)."""
    steps: list[SinkStep] = []
    for rec in records:
        by_step: dict[int, tuple[float, dict]] = {}
        for step, wall_time, values in rec.scalars or ():
            wall, merged = by_step.setdefault(int(step), (wall_time, {}))
            merged.update(values)
        params = rec.stats or None
        if params is not None:
            by_step.setdefault(int(rec.step), (rec.wall_time, {}))
        for step in sorted(by_step):
            wall, scalars = by_step[step]
            steps.append(SinkStep(optimizer=int(rec.optimizer), step=step, wall_time=float(wall),
                                  params=params if params is not None and step == rec.step else {},
                                  scalars=scalars))
    return steps


class SinkFeed:
    """The sinks of one recorder. ``warn(text)`` tells the user (once per sink) that a sink raised and was dropped;
    training and the run file go on."""

    def __init__(self, sinks: Sequence[Sink], warn: Callable[[str], None], alerts=None):
        self.sinks = list(sinks)
        self.alerts = alerts  # upd.recorder.alerts.LiveAlerts: checks each statistics step before the sinks see it
        self.dropped: list[Sink] = []  # sinks that raised: fed no more, closed quietly at close()
        self.warn = warn

    def records_written(self, records: list[Record]) -> None:
        """The run file writer's on_written hook."""
        if self.sinks or self.alerts is not None:
            steps = sink_steps(records)
            if self.alerts is not None and steps:
                steps = self.alerts.check_records(records, steps)
            if steps and self.sinks:
                self.deliver(steps)

    def deliver(self, steps: list[SinkStep]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(steps)
            except Exception as exc:
                self._drop(sink, "write", exc)

    def _drop(self, sink, what: str, exc: Exception) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
            self.dropped.append(sink)
        self.warn(f"torch-upd: the sink {sink!r} raised in {what}() ({type(exc).__name__}: {exc}) and gets "
                  "nothing more; training and the run file go on.")

    def close(self) -> None:
        """Close every sink still fed (once; a sink dropped after an error is closed too, quietly)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                self.warn(f"torch-upd: the sink {sink!r} raised in close() ({type(exc).__name__}: {exc}).")
        dropped, self.dropped = self.dropped, []
        for sink in dropped:
            try:
                sink.close()
            except Exception:
                pass  # it raised before and was warned about then


def close_unused(sinks: Sequence[Sink], warn: Callable[[str], None]) -> None:
    """Close sinks this process does not feed (another rank writes the job's live values)."""
    SinkFeed(sinks, warn).close()
