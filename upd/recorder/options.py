"""The checks of ``upd.record``'s value options, in a module that imports no torch.

The recorder makes them before anything else; the launcher (``upd record``) makes the same ones before it starts
the user's command, so that a bad option is refused with the recorder's own message in a process that never needs
torch (importing it costs seconds on a small machine, and the command imports it again anyway).
"""
from __future__ import annotations

from ..runfile import schema

ZERO_COUNT_KINDS = ("param", "grad", "update", "state")
# The smallest stats_sample: below it a sample's std is off by more than a few percent (relative standard error
# ~ 1/sqrt(2K)), no longer a useful estimate of update:data (upd/recorder/sampled_stats.py).
MIN_STATS_SAMPLE = 256


def check_record_options(*, every=1, stats_every=None, full_stats_every=100, flight_recorder=None,
                         spike_factor=10.0, what=schema.WHAT_CHOICES, dtype="keep", compression=None,
                         zero_counts=("grad",), tensorboard=None, overwrite=False, resume=False,
                         stats_sample=None) -> None:
    """Raise ValueError naming the first option upd.record would refuse; the defaults are upd.record's."""
    for label, cadence in (("every", every), ("stats_every", stats_every), ("full_stats_every", full_stats_every)):
        if cadence is not None and (not isinstance(cadence, int) or isinstance(cadence, bool) or cadence < 1):
            raise ValueError(f"{label} must be a positive integer or None, got {cadence!r}")
    if stats_sample is not None and (not isinstance(stats_sample, int) or isinstance(stats_sample, bool)
                                     or stats_sample < MIN_STATS_SAMPLE):
        raise ValueError(f"stats_sample must be a number of elements >= {MIN_STATS_SAMPLE} or None (exact "
                         f"statistics), got {stats_sample!r}")
    if flight_recorder is not None and (not isinstance(flight_recorder, int) or flight_recorder < 1):
        raise ValueError(f"flight_recorder must be a positive number of steps or None, got {flight_recorder!r}")
    if not spike_factor > 1:
        raise ValueError(f"spike_factor must be > 1, got {spike_factor!r}")
    if every is None and stats_every is None and tensorboard is None and flight_recorder is None:
        raise ValueError("every=None and stats_every=None would record nothing")  # tensorboard= implies stats
    unknown = set((what,) if isinstance(what, str) else what) - set(schema.WHAT_CHOICES)
    if unknown:
        raise ValueError(f"what= accepts {schema.WHAT_CHOICES}, got {sorted(unknown)}")
    if dtype not in schema.STORAGE_DTYPES:
        raise ValueError(f"dtype= must be one of {schema.STORAGE_DTYPES}, got {dtype!r}")
    if compression not in (None, "gzip", "lzf"):
        raise ValueError(f"compression= must be None, 'gzip' or 'lzf', got {compression!r}")
    if set((zero_counts,) if isinstance(zero_counts, str) else zero_counts) - set(ZERO_COUNT_KINDS):
        raise ValueError(f"zero_counts= takes 'param', 'grad', 'update', 'state'; got {zero_counts!r}")
    if overwrite and resume:
        raise ValueError("pass overwrite=True or resume=True, not both")
