"""The statistics of a whole tensor from the statistics of its shards, exactly, without reading any tensor.

Under FSDP2 each rank records the summary statistics of its own shard of a parameter, gradient, update and optimizer
state (statistics mode, ``stats_every=``); the reader combines them into those of the logical tensor. Every
statistic the recorder keeps (mean, unbiased std, L2 norm, abs max, fraction of zeros, NaN/Inf count) determines,
with the shard's element count, a sufficient statistic that adds up over shards:

    count n = the shard's numel          sum = mean * n            sum of squares = norm^2
    max |x| = max of the absmax          zeros = zero_frac * n     NaN/Inf = sum of the counts

The std is combined by the parallel-variance identity (Chan, Golub and LeVeque), merging shards pairwise with each
one's centred sum of squares M2 = std^2 * (n - 1) and the distance between their means. In exact arithmetic that
equals the textbook (sum of squares - sum^2 / N) / (N - 1); with the statistics stored as float32 it does not cancel
catastrophically when |mean| >> std (a norm layer's scale near 1), where the textbook form loses every digit.

Shards merge one at a time (``merge`` is associative), so a job's statistics are combined reading one rank's table
after another: memory is that of one rank's table, whatever the number of ranks. Pure functions on numpy arrays
(one value per step); ``ShardCombiner`` is the only part that knows the statistics table's column names.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..ratios import GRAD_TO_DATA, UPDATE_TO_DATA, grad_to_data, update_to_data
from ..statistics import STATE_PREFIX, STD, NONFINITE, finish, merge, split_column, sufficient
from ..statistics import _values as _column


def scalar_rows(counts, stats: dict) -> np.ndarray:
    """(S,) True where a state kind's statistics are those of a scalar every rank holds whole (Adam's ``step``), not
    of a shard: every shard of two or more elements reports no spread (std NaN) although it holds no NaN/Inf.

    A state tensor is either sharded like its parameter or a plain scalar on every rank; the statistics table does
    not store its shape, and this is what tells them apart. When no shard has two elements the two readings agree
    on every rank but one, and the shard reading is kept."""
    rows = np.asarray(next(iter(stats.values()))).shape[1]
    multi = np.zeros(rows, dtype=bool)
    every = np.ones(rows, dtype=bool)
    for i, count in enumerate(counts):
        if count >= 2:
            std = _column({k: np.asarray(v)[i] for k, v in stats.items()}, "std", rows)
            nonfinite = _column({k: np.asarray(v)[i] for k, v in stats.items()}, "nonfinite", rows)
            multi[:] = True
            every &= np.isnan(std) & (nonfinite == 0)
    return multi & every


class ShardCombiner:
    """One parameter's rows of the statistics table (columns "<kind>_<stat>", lr, ...) combined over its shards,
    added one shard (one rank's rows) at a time, at the given steps.

    A step is kept when every shard added has it. Columns that are not "<kind>_<stat>" are the first shard's;
    update_to_data and grad_to_data are recomputed from the combined stds. State kinds that are scalars on every
    rank (``scalar_rows``) keep the first shard's values."""

    def __init__(self, steps):
        self.steps = np.asarray(steps, dtype=np.int64)
        self.present = np.ones(len(self.steps), dtype=bool)
        self.columns: list[str] = []
        self.plain: dict[str, np.ndarray] = {}  # columns taken from the first shard
        self.totals: dict[str, dict] = {}  # kind -> merged sufficient statistics
        self.first: dict[str, dict] = {}  # kind -> the first shard's statistics (a scalar's values)
        self.multi: dict[str, np.ndarray] = {}  # kind -> rows where a shard of >= 2 elements was added
        self.no_spread: dict[str, np.ndarray] = {}  # kind -> rows where all those reported std NaN, no NaN/Inf

    def add(self, count: int, frame: pd.DataFrame) -> None:
        """Add one shard: its element count and its rows (a "step" column, one row per step)."""
        if count <= 0:  # an empty shard adds nothing (its statistics are NaN, its rows absent)
            return
        frame = frame.drop_duplicates("step").set_index("step")
        self.present &= np.isin(self.steps, frame.index.to_numpy())
        frame = frame.reindex(self.steps)
        kinds: dict[str, dict] = {}
        for column in frame.columns:
            if column not in self.columns:
                self.columns.append(column)
            parts = split_column(column)
            if parts is None:
                if column not in (UPDATE_TO_DATA, GRAD_TO_DATA):
                    self.plain.setdefault(column, frame[column].to_numpy())
            else:
                kinds.setdefault(parts[0], {})[parts[1]] = frame[column].to_numpy(dtype=np.float64)
        rows = len(self.steps)
        for kind, stats in kinds.items():
            self.first.setdefault(kind, stats)
            self.totals[kind] = merge(self.totals.get(kind), sufficient(count, stats))
            if count >= 2:
                spread = np.isnan(_column(stats, STD, rows)) & (_column(stats, NONFINITE, rows) == 0)
                self.no_spread[kind] = self.no_spread.get(kind, np.ones(rows, dtype=bool)) & spread
                self.multi[kind] = np.ones(rows, dtype=bool)

    def frame(self) -> pd.DataFrame:
        """The combined rows: a "step" column, then the columns in the order the shards had them."""
        keep = self.present
        rows = len(self.steps)
        out = {"step": self.steps[keep]}
        for column, values in self.plain.items():
            out[column] = values[keep]
        for kind, total in self.totals.items():
            combined = finish(total, rows)
            scalar = self.multi.get(kind, np.zeros(rows, bool)) & self.no_spread.get(kind, np.zeros(rows, bool))
            for stat, values in self.first[kind].items():
                whole = np.where(scalar, values, combined[stat]) if kind.startswith(STATE_PREFIX) else combined[stat]
                out[f"{kind}_{stat}"] = whole[keep]
        frame = pd.DataFrame(out)
        nan = np.full(len(frame), np.nan)
        if any(c in self.columns for c in (UPDATE_TO_DATA, GRAD_TO_DATA)):
            param_std = frame["param_std"].to_numpy() if "param_std" in frame else nan
            frame[UPDATE_TO_DATA] = update_to_data(frame["update_std"].to_numpy() if "update_std" in frame else nan,
                                                   param_std)
            frame[GRAD_TO_DATA] = grad_to_data(frame["grad_std"].to_numpy() if "grad_std" in frame else nan,
                                               param_std)
        return frame[[c for c in ["step"] + self.columns if c in frame]]
