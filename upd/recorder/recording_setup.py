"""What a recorder works out before it writes anything: the file it may write, what its tracks record with, and
the tracks themselves with everything the run's metadata needs from the model and the optimizers.

Each piece is a function of the call (the options, what ``attaching.attach`` found, the live role): the ``Recorder``
decides, from what they return or raise, whether it records or stays inactive with one warning.
"""
from __future__ import annotations

import dataclasses
import os

from .. import lifetime
from .attaching import Attached
from .backward import BackwardCounts
from .live import LiveRole
from .naming import ParamNames, model_names, named_parameters
from .options import RecordOptions
from .resume import initial_step
from .track import OptimizerTrack, TrackSettings


def refuse_directory(path: str) -> None:
    """IsADirectoryError for a directory given as the run file: a mistake to say at once, not a recorder to leave
    inactive."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; upd.record writes one file: pass a file path, "
                                f"e.g. {os.path.join(path, 'run.h5')}")


def recording_to(path: str):
    """The active recorder of this process that writes `path`, if any."""
    try:
        real = os.path.realpath(path)
    except OSError:
        return None
    for recorder in list(lifetime.recorders):
        if recorder.active and os.path.realpath(recorder.path) == real:
            return recorder
    return None


def held_by_another_recorder(path: str) -> RuntimeError | None:
    """Why `path` cannot be recorded to when an active recorder of this process writes it, else None.

    A notebook cell run again while its first recorder is still open: HDF5 would refuse the file with its own text
    and leave a dead recorder; say which recorder holds it instead."""
    holder = recording_to(path)
    if holder is None:
        return None
    return RuntimeError(f"{holder!r} in this process is still recording to this file; close it first (rec.close(), "
                        "or record inside `with upd.record(...)`), or record to another path")


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # nothing there, or not ours to remove after all: either way not the training's concern


def track_settings(opts: RecordOptions, stats_every: int | None, include: list, exclude: list, rank_setup,
                   live: LiveRole) -> TrackSettings:
    """What every track of the recorder records with: `opts` with the values the recorder records with
    (`stats_every` as ``live.recorded_stats_every`` says, the include/exclude patterns), and the roles it decided."""
    return TrackSettings(
        every=opts.every, stats_every=stats_every, full_stats_every=opts.full_stats_every,
        # A job's statistics are its local parts' exact ones: stats_sample is for single-process runs.
        stats_sample=None if rank_setup is not None else opts.stats_sample,
        what=opts.what, zero_counts=opts.zero_counts, include=include, exclude=exclude, rank_setup=rank_setup,
        keeps_every_step=opts.flight_recorder is not None, feeds_sinks=live.feeds_sinks and live.has_sinks,
        shares_job_statistics=live.shares_job_statistics, dtype=opts.dtype)


@dataclasses.dataclass(frozen=True)
class TrackedOptimizers:
    """The recorder's tracks, with what the run's metadata needs from the model and the optimizers."""

    tracks: list  # OptimizerTrack, one per optimizer, in the run's order
    metas: list  # each optimizer's entry in the run's metadata (OptimizerTrack.meta)
    not_optimized: list | None  # names of the model's parameters no optimizer holds; None without a model

    def param_names(self) -> list[str]:
        return [p["name"] for meta in self.metas for p in meta["params"]]


def tracked_optimizers(attached: Attached, settings: TrackSettings, backward: BackwardCounts) -> TrackedOptimizers:
    """One track per optimizer `attached` found, and its metadata, read before the file exists: an object that only
    looks like a model or an optimizer fails here (any exception), and leaves no file behind."""
    names_in_model = model_names(attached.model)
    tracks = [OptimizerTrack(i, opt, job_opt, ParamNames({**names_of_places, **names_in_model}), initial_step(opt),
                             settings, backward)
              for i, (opt, job_opt, names_of_places)
              in enumerate(zip(attached.optimizers, attached.job_optimizers, attached.global_names))]
    metas = [track.meta() for track in tracks]
    # A ZeRO rank's local optimizer holds its partition only; the job's optimizer holds them all.
    optimized = {id(p) for opt in attached.job_optimizers for g in opt.param_groups for p in g["params"]}
    not_optimized = None if attached.model is None else [
        name for name, p in named_parameters(attached.model) if id(p) not in optimized]
    return TrackedOptimizers(tracks, metas, not_optimized)
