"""The recorder's live outputs (``LiveOutputs``): the sinks (``sinks=``, and ``tensorboard=`` as one more sink), the
live alerts (``alerts=``) and a split job's shared statistics, with which process feeds the sinks (``LiveRole``)
and the statistics cadence they need.

Live values come from the statistics the writer gets anyway, so they add no work of their own to a step but the
scalars' host copy; ``alerts=`` alone reads the statistics it already has. Who feeds the sinks in a distributed job
is ``distributed.sink_role``'s answer; how the values reach them is ``upd.sinks.feed``'s; what a split job's ranks
share for them is ``job_scalars``'.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from ..sinks.feed import SINKS_JOB, SINKS_OWN, SinkFeed, close_unused, sink_problem
from ..sinks.tensorboard import TensorBoard
from . import distributed, job_scalars
from .alerts import LiveAlerts
from .cadence import AUTO
from .job_scalars import JobScalars
from .options import RecordOptions

ALERTS_NOT_IN_SPLIT_JOB = ("torch-upd: alerts= is not checked in a job whose ranks hold parts of the parameters "
                           "(this version); recording goes on without it.")


def check_sinks(sinks) -> None:
    """TypeError for a ``sinks=`` entry that is not a sink: refused before anything else, like a bad option."""
    for sink in sinks:
        problem = sink_problem(sink)
        if problem:
            raise TypeError(f"sinks= takes objects with write(steps) and close() (upd.sinks.Sink): {problem}")


def recorded_stats_every(opts: RecordOptions) -> int | None:
    """The statistics cadence recorded with: at every step unless ``stats_every`` says, when live values need them
    or ``every="auto"`` records full tensors only now and then."""
    return 1 if (opts.live() or opts.every == AUTO) and opts.stats_every is None else opts.stats_every


@dataclasses.dataclass(frozen=True)
class LiveRole:
    """This process's part in the live outputs."""

    role: str | None  # distributed.sink_role; None without sinks=, tensorboard= or alerts=
    feeds_sinks: bool  # this process feeds the sinks (a split job's rank 0 feeds the job's combined statistics)
    has_sinks: bool  # sinks= or tensorboard= (alerts alone need no extra scalar host copy per statistics step)
    alerts_unchecked: bool  # rank 0 of a split job with alerts=: not checked there (this version); warned once

    @property
    def shares_job_statistics(self) -> bool:
        """A split job's live statistics: every rank adds its parts' statistics, rank 0 feeds the sinks
        (job_scalars)."""
        return self.role == SINKS_JOB


def live_role(opts: RecordOptions, rank_setup) -> LiveRole:
    """This process's LiveRole in a recording with `opts` (ValueError from ``sink_role`` for live sinks in a split
    job that does not record on every rank)."""
    role = distributed.sink_role(rank_setup) if opts.live() else None
    rank_zero = rank_setup is not None and rank_setup.rank == 0
    return LiveRole(role=role, feeds_sinks=role == SINKS_OWN or (role == SINKS_JOB and rank_zero),
                    has_sinks=bool(opts.sinks) or opts.tensorboard is not None,
                    alerts_unchecked=role == SINKS_JOB and opts.alerts is not None and rank_zero)


def sinks_fed(opts: RecordOptions) -> list:
    """The sinks the feeding process writes to: ``tensorboard=`` is shorthand for a TensorBoard sink, first. Made
    only by the process that feeds them: the others make no SummaryWriter."""
    return list(opts.sinks) if opts.tensorboard is None else [TensorBoard(opts.tensorboard), *opts.sinks]


class LiveOutputs:
    """A recorder's live outputs: the sinks it was given (closed with it, fed or not), the feed of those this process
    writes to, its live alerts, and a split job's shared statistics. Made with the recorder, so that an inactive one
    still closes its sinks; ``wire`` then gives this process its part, once the recorder knows it."""

    def __init__(self, opts: RecordOptions):
        self.given = list(opts.sinks)
        self.alerts = LiveAlerts(opts.alerts, dump=opts.flight_recorder is not None) if opts.alerts else None
        self.feed: SinkFeed | None = None  # the sinks this process feeds (sink_role)
        self.job_scalars: JobScalars | None = None  # a split job's live statistics (job_scalars)

    def wire(self, opts: RecordOptions, role: LiveRole, rank_setup, stats_every: int | None, tracks: list,
             warn_sink: Callable[[str], None], warn_job_scalars: Callable[[str], None]) -> None:
        """Feed the sinks where `role` says this process does, and join a split job's shared statistics of `tracks`
        (the recorder's OptimizerTracks, in the run's order)."""
        if role.feeds_sinks:
            # Only the process that writes makes a SummaryWriter. A split job's rank 0 feeds the job's combined
            # statistics (feed_job_step), not its own part's.
            self.feed = SinkFeed(sinks_fed(opts), warn_sink, alerts=self.alerts)
        if role.shares_job_statistics:  # every rank adds its parts' statistics, rank 0 feeds the sinks
            self.job_scalars = JobScalars(rank_setup.rank, rank_setup.world_size, stats_every,
                                          [track.steps_done for track in tracks],
                                          lambda index: tracks[index].slots(), warn_job_scalars)

    def writer_hooks(self) -> dict:
        """The run file writer's hooks: single-process sinks are fed from the writer thread, with the records it has
        written (a split job's rank 0 feeds the job's statistics instead, feed_job_step)."""
        return {"on_written": self.feed.records_written} if self.feed is not None and self.job_scalars is None \
            else {}

    def feed_job_step(self, writer, track, combined: tuple | None) -> None:
        """Hand rank 0's sinks the job's whole-parameter statistics of `track`'s step (when it had them) with the
        scalar rows read so far, on `writer`'s thread."""
        rows, track.live_rows = track.live_rows, []
        steps = job_scalars.sink_steps(track.index, rows, combined)
        if steps:
            writer.run_later(functools.partial(self.feed.deliver, steps))

    def close(self, warn_sink: Callable[[str], None]) -> None:
        """Every sink closed once, after the writer thread has fed them the last records; those this process did
        not feed (another rank writes the job's live values) closed unused."""
        feed, self.feed = self.feed, None
        if feed is not None:
            feed.close()
        else:
            close_unused(self.given, warn_sink)
        self.given = []
