"""The statistics vocabulary, declared once: which statistics a run records of each tensor, which kinds of tensor
there are, what the columns are called and how each statistic merges across the shards of a tensor.

A base module (numpy only: no torch, nothing of torch-upd): the recorder computes these statistics
(``recorder/device_stats.py``, ``sampled_stats.py``), the run file stores them as columns ``<kind>_<stat>``, the
shard merge (``runfile/shard_stats.py``, ``recorder/job_scalars.py``) combines them by each one's ``MERGE`` rule,
the analyzer and every live sink read them by these names.

Adding a statistic: its math in ``device_stats`` (the full set) and one entry in ``STATS`` and ``MERGE`` here.
"""
from __future__ import annotations

import numpy as np

# Every statistic of a tensor in the full set, in the order the statistics kernels fill a row.
MEAN, STD, NORM, ABSMAX, ZERO_FRAC, NONFINITE = "mean", "std", "norm", "absmax", "zero_frac", "nonfinite"
STATS = (MEAN, STD, NORM, ABSMAX, ZERO_FRAC, NONFINITE)

# How each statistic of a whole tensor follows from its shards' (element counts n_i): the rules
# ``runfile/shard_stats.py`` implements, one each.
WEIGHTED_MEAN = "count-weighted mean"  # sum n_i mean_i / n
POOLED_STD = "pooled spread"  # the shards' own spreads plus their means' spread around the whole's (Chan et al.)
ROOT_SUM_SQUARES = "root of the summed squares"  # sqrt(sum norm_i^2)
MAXIMUM = "maximum"
COUNT_FRACTION = "count-weighted fraction"  # sum n_i frac_i / n
SUM = "sum"
MERGE = {MEAN: WEIGHTED_MEAN, STD: POOLED_STD, NORM: ROOT_SUM_SQUARES, ABSMAX: MAXIMUM, ZERO_FRAC: COUNT_FRACTION,
         NONFINITE: SUM}

# The kinds of tensor a parameter's statistics are of: "state.<key>" for each optimizer-state tensor.
PARAM, GRAD, UPDATE = "param", "grad", "update"
STATE_PREFIX = "state."

# The lean set, computed at most statistics steps: these statistics of these kinds (and the two ratios). Live sinks
# in a split job combine exactly these kinds over the ranks (``recorder/job_scalars.py``).
LEAN_KINDS = (PARAM, GRAD, UPDATE)
LEAN_STATS = (MEAN, STD, NORM, NONFINITE)

# The ratios of the stds, log10 (``upd.ratios``).
UPDATE_TO_DATA, GRAD_TO_DATA = "update_to_data", "grad_to_data"
RATIOS = (UPDATE_TO_DATA, GRAD_TO_DATA)


def column(kind: str, stat: str) -> str:
    """The statistics table's column of `stat` of `kind`: "grad_zero_frac"."""
    return f"{kind}_{stat}"


# Longest first: a column "<kind>_<stat>" ends with exactly one of these (statistics' names hold underscores).
_STATS_BY_LENGTH = sorted(STATS, key=len, reverse=True)


def split_column(name: str) -> tuple[str, str] | None:
    """("grad", "zero_frac") for "grad_zero_frac"; None for a column that is not "<kind>_<stat>"."""
    for stat in _STATS_BY_LENGTH:
        if name.endswith("_" + stat) and len(name) > len(stat) + 1:
            return name[: -len(stat) - 1], stat
    return None


LEAN_COLUMNS = tuple(column(kind, stat) for kind in LEAN_KINDS for stat in LEAN_STATS) + RATIOS
# What a live sink shows per parameter, in this order (``upd.sinks.base.LIVE_COLUMNS``): made of LEAN_KINDS only.
LIVE_COLUMNS = (UPDATE_TO_DATA, GRAD_TO_DATA, column(UPDATE, NORM), column(GRAD, NORM), column(PARAM, NORM))



# -- the merge rules --------------------------------------------------------------------------------------------
# Each statistic's MERGE rule in three steps over arrays of rows (steps or parameters): `sufficient` turns one
# shard's recorded statistics into what adds up (a mean, a spread m2 = std^2 (n - 1), a sum of squares, a maximum, a
# count, a sum), `merge` combines two shards', `finish` gives back the recorded statistics of the whole. Keys are the
# statistics' names, and "n", the element count.

def _values(stats: dict, stat: str, rows: int) -> np.ndarray:
    value = stats.get(stat)
    return np.full(rows, np.nan) if value is None else np.asarray(value, dtype=np.float64)


def sufficient(count: int, stats: dict) -> dict:
    """One shard's sufficient statistics from its recorded ones ({stat: (S,) array}); a missing statistic gives
    NaN."""
    rows = len(next(iter(stats.values())))
    n = float(count)
    out = {"n": n}
    for stat, rule in MERGE.items():
        v = _values(stats, stat, rows)
        if rule == POOLED_STD:
            # A one-element shard has no spread of its own (its std is NaN by definition, not by a NaN value).
            out[stat] = v * v * (n - 1) if n >= 2 else np.zeros(rows)
        elif rule == ROOT_SUM_SQUARES:
            out[stat] = v * v
        elif rule == COUNT_FRACTION:
            out[stat] = v * n
        else:  # WEIGHTED_MEAN, MAXIMUM, SUM: the value itself
            out[stat] = v
    return out


def merge(a: dict | None, b: dict) -> dict:
    """The sufficient statistics of two shards together (Chan et al.'s pairwise update for the spread)."""
    if a is None:
        return b
    n = a["n"] + b["n"]
    out = {"n": n}
    with np.errstate(invalid="ignore"):
        delta = b[MEAN] - a[MEAN]  # the spread's pairwise term is of the values' mean
        for stat, rule in MERGE.items():
            if rule == WEIGHTED_MEAN:
                out[stat] = a[stat] + (b[stat] - a[stat]) * (b["n"] / n)  # for MEAN itself: + delta * (n_b / n)
            elif rule == POOLED_STD:
                out[stat] = a[stat] + b[stat] + delta * delta * (a["n"] * b["n"] / n)
            elif rule == MAXIMUM:
                out[stat] = np.maximum(a[stat], b[stat])  # NaN from either side stays NaN
            else:  # ROOT_SUM_SQUARES, COUNT_FRACTION, SUM: sums
                out[stat] = a[stat] + b[stat]
    return out


def finish(total: dict | None, rows: int) -> dict:
    """The recorded statistics (STATS) of the merged shards; all NaN when no shard had elements."""
    if total is None or total["n"] == 0:
        return {stat: np.full(rows, np.nan) for stat in STATS}
    n = total["n"]
    out = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for stat, rule in MERGE.items():
            v = total[stat]
            if rule == POOLED_STD:
                out[stat] = np.sqrt(v / (n - 1)) if n >= 2 else np.full(rows, np.nan)
            elif rule == ROOT_SUM_SQUARES:
                out[stat] = np.sqrt(v)
            elif rule == COUNT_FRACTION:
                out[stat] = v / n
            else:
                out[stat] = v
    return out
