"""The statistics engines: which one computes a step's statistics, and what every one of them does.

Three engines compute a step's statistics, each launched on the device before the step (what the step changes)
and read after it with one device-to-host copy: the full set (``device_stats.StepStatistics``: every statistic of
the parameter, its gradient, its update and each optimizer-state tensor), the lean set (``device_stats.LeanStep``:
mean, std, norm and NaN/Inf count of the parameter, its gradient and its update, from buffers it keeps) and the lean
set estimated from samples (``sampled_stats.SampledStep``). ``statistics_set`` chooses, from the step and the
options alone; the recorder falls back to the full set where the lean one does not apply (DTensors, sparse or
integer tensors: ``device_stats.lean_applies``).
"""
from __future__ import annotations

from typing import Mapping, Protocol

FULL, LEAN, SAMPLED = "full", "lean", "sampled"


class StatisticsEngine(Protocol):
    """One step's statistics: launched (by its constructor or ``launch``) before the step; ``after_step(step)``
    launches what needs the values after it and reads everything, {parameter name: {column: value}}. `step` is
    the recorder's step in progress (its tracked parameters, whether the step is full or took a closure). The lean
    engines also give, once ``after_step`` returned, ``grad_norm``: the total norm of the step's gradients (a float,
    from the step's host copy)."""

    def after_step(self, step) -> Mapping[str, Mapping[str, float]]: ...


def statistics_set(step: int, *, stats_every: int | None, full_stats_every: int | None, full_record: bool,
                   stats_sample: int | None) -> str | None:
    """Which statistics step `step` computes: None (none), FULL, LEAN or SAMPLED.

    Statistics steps are every ``stats_every``-th; a step with full tensors (every=, the flight recorder) and every
    ``full_stats_every``-th step get the full set, the others the lean set, from samples when ``stats_sample``
    is given (single-process runs: the recorder passes None in a distributed job)."""
    if stats_every is None or step % stats_every:
        return None
    if full_record or (full_stats_every is not None and step % full_stats_every == 0):
        return FULL
    return LEAN if stats_sample is None else SAMPLED
