"""Which recorded steps the histograms use, and how to say it in a few characters.

Histograms need full tensors, which a statistics-mode run has at a few steps only (``every=500``), while its
ratios cover every step: the analysis must pick among the full records, validate a ``--step`` against them
before any work, and say which steps it used. Kept free of matplotlib so that the check costs no import.
"""
from __future__ import annotations

import numpy as np

from ..runfile import schema
from .summary import is_weight

HISTOGRAM_KINDS = (schema.KIND_GRAD, schema.KIND_PARAM)  # what the histograms draw


def histogram_keys(params, all_params: bool = False) -> list[tuple[int, str]]:
    """(optimizer, param) of the tensors the histograms may show, in model order: the weights (ndim >= 2), or every
    parameter with all_params."""
    return [(r.optimizer, r.param) for r in params.itertuples() if all_params or is_weight(r.shape)]


def full_record_steps(run, keys, kinds=HISTOGRAM_KINDS) -> np.ndarray:
    """Sorted optimizer steps at which any of `keys` has a full-tensor record of one of `kinds`."""
    keys = set(keys)
    found = set()
    for p in run.iter_params():
        if (p.optimizer.index, p.name) in keys and p.num_rows and any(k in p.kinds for k in kinds):
            found.update(int(s) for s in p.optimizer.steps[p.records])
    return np.array(sorted(found), dtype=np.int64)


def compared_steps(available, step: int | None = None) -> list[int]:
    """The steps the histograms compare: `step` alone when given (ValueError unless it is among `available`,
    naming the valid ones), else the first, the one nearest the middle step and the last available (by step, not by
    position: the default cadence's records at steps 0, 1, 100, 200 compare 0, 100 and 200)."""
    available = np.asarray(available, dtype=np.int64)
    if step is not None:
        if int(step) not in set(available.tolist()):
            where = f"full-tensor records are at steps {describe_steps(available)}" if len(available) else \
                "the run has no full-tensor record of a weight"
            raise ValueError(f"no full-tensor record at step {step} to draw histograms from; {where}")
        return [int(step)]
    if not len(available):
        return []
    middle = available[int(np.argmin(np.abs(2 * available - (available[0] + available[-1]))))]
    picks = [available[0], middle, available[-1]]
    return sorted({int(s) for s in picks})


def describe_steps(steps) -> str:
    """'0..19', '0, 25, ..., 150 (every 25)' or a short list: a set of steps in a few characters."""
    steps = [int(s) for s in steps]
    if not steps:
        return "none"
    if len(steps) <= 4:
        return ", ".join(map(str, steps))
    gaps = set(np.diff(steps).tolist())
    if gaps == {1}:
        return f"{steps[0]}..{steps[-1]}"
    if len(gaps) == 1:
        return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} (every {gaps.pop()})"
    return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} ({len(steps)} steps)"
