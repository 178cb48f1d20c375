"""The rules that turn one step's numbers into alerts, for the analyzer's findings and the recorder's live checks.

Each rule is a pure function of the values one statistics step already has on the host, per parameter a mapping
{column: value} with the column names of the statistics table (``update_to_data``, ``update_norm``,
``grad_norm``, ``grad_zero_frac``, ``grad_nonfinite``, ``state.exp_avg_sq_mean``, ...). The rules use numpy
operations only, so each one also takes whole columns (one array per column, one element per step) and returns
the per-step answer as an array: ``upd analyze`` applies them to a run's columns at once, a live checker to one
step's scalars, and both get the same answer (tests/analyzer/test_findings.py checks it step by step).

The one rule that needs the past, the update-norm spike, compares a value with a baseline: the median of the
same parameter's previous ``spike_window`` finite, positive values (``NormHistory`` keeps them live;
``spike_baselines`` computes them for a whole column). Thresholds and why they are what they are:
docs/diagnosis.md.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from .statistics import GRAD, MEAN, NONFINITE as NONFINITE_STAT, NORM, PARAM, STATE_PREFIX, STD, UPDATE, \
    UPDATE_TO_DATA, ZERO_FRAC, column

# The columns the rules read, in the statistics vocabulary (upd/statistics.py).
UPDATE_NORM = column(UPDATE, NORM)
GRAD_NORM = column(GRAD, NORM)
GRAD_ZERO_FRAC = column(GRAD, ZERO_FRAC)
NONFINITE_COLUMNS = tuple(column(kind, NONFINITE_STAT) for kind in (GRAD, PARAM, UPDATE))
EXP_AVG_MEAN, EXP_AVG_STD = column(STATE_PREFIX + "exp_avg", MEAN), column(STATE_PREFIX + "exp_avg", STD)
EXP_AVG_SQ_MEAN = column(STATE_PREFIX + "exp_avg_sq", MEAN)

# Alert kinds, one per rule.
OUT_OF_BAND = "out_of_band"
NONFINITE = "nonfinite"
NOT_MOVING = "not_moving"
UPDATE_SPIKE = "update_spike"
SECOND_MOMENT_COLLAPSE = "second_moment_collapse"
EXP_AVG_RATIO = "exp_avg_ratio"

# Why a weight does not move, the reasons not_moving returns (0: it moves).
MOVING, GRAD_ZERO, GRAD_MOSTLY_ZERO, UPDATE_ZERO = 0, 1, 2, 3


@dataclass(frozen=True)
class AlertRules:
    """The thresholds of every rule (docs/diagnosis.md gives the reasons)."""

    low: float = -4.5  # band on update:data (log10), as the summary's Thresholds
    high: float = -1.5
    spike_factor: float = 10.0  # an update norm above this times its baseline is a spike (the flight recorder's)
    spike_window: int = 20  # the baseline: median of this many previous steps' norms
    spike_min_history: int = 5  # ... once at least this many are known
    dead_zero_frac: float = 0.99  # a gradient with at least this fraction of exact zeros is dead
    exp_avg_ratio_limit: float = 10.0  # RMS(exp_avg) / sqrt(mean(exp_avg_sq)) above this is not Adam's math
    second_moment_floor: float = 1e-8  # sqrt(mean(exp_avg_sq)) below this (Adam's default eps) has collapsed

    def __post_init__(self):
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if not self.spike_factor > 1:
            raise ValueError(f"spike_factor must be above 1, got {self.spike_factor}")
        if self.spike_window < 1 or not 1 <= self.spike_min_history <= self.spike_window:
            raise ValueError("need spike_window >= spike_min_history >= 1")


def is_weight(shape) -> bool:
    """Weights are the matrices and kernels (ndim >= 2), the tensors Karpathy's plot shows; biases and norm
    scales are summarised but not judged by the band, since their ratios are not expected to sit near -3."""
    return len(tuple(shape)) >= 2


def _get(values, column):
    """values[column] as float64 (scalar or array); NaN when the step did not measure it."""
    value = values.get(column)
    return np.asarray(np.nan if value is None else value, dtype=np.float64)


def out_of_band(values, rules: AlertRules = AlertRules()):
    """-1 where update:data is finite and below the band, +1 above it, 0 inside (or not finite: see not_moving)."""
    ratio = _get(values, UPDATE_TO_DATA)
    finite = np.isfinite(ratio)
    return np.where(finite & (ratio > rules.high), 1, np.where(finite & (ratio < rules.low), -1, 0))


def nonfinite(values):
    """The NaN/Inf elements counted in the parameter, its gradient and its update (0: none; NaN counts as 0)."""
    counts = [np.nan_to_num(_get(values, c), nan=0.0) for c in NONFINITE_COLUMNS]
    return np.abs(sum(counts))


def not_moving(values, rules: AlertRules = AlertRules()):
    """Why a parameter did not move at this step: GRAD_ZERO (its gradient is exactly zero: no signal reaches it),
    GRAD_MOSTLY_ZERO (at least dead_zero_frac of the gradient's elements are exactly zero, measured at full-set
    steps), UPDATE_ZERO (the gradient is not zero but the update is: lr 0 or an optimizer that skips it), or
    MOVING."""
    grad_norm, update_norm = _get(values, GRAD_NORM), _get(values, UPDATE_NORM)
    zero_frac = _get(values, GRAD_ZERO_FRAC)
    return np.where(grad_norm == 0, GRAD_ZERO,
                    np.where(zero_frac >= rules.dead_zero_frac, GRAD_MOSTLY_ZERO,
                             np.where((update_norm == 0) & (grad_norm > 0), UPDATE_ZERO, MOVING)))


def update_spike(values, baseline, rules: AlertRules = AlertRules()):
    """How many times its baseline the update norm is, where that is above spike_factor, else 0 (and 0 where no
    baseline is known yet)."""
    norm = _get(values, UPDATE_NORM)
    baseline = np.asarray(baseline, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = norm / baseline
    return np.where(np.isfinite(factor) & (baseline > 0) & (factor > rules.spike_factor), factor, 0.0)


def exp_avg_ratio(values):
    """RMS(exp_avg) / sqrt(mean(exp_avg_sq)) (Adam's first and second moments; NaN without them). The RMS comes from
    the recorded mean and std (mean^2 + std^2, the std's n-1 aside). Adam's own recursions keep it below about 7 with
    the default betas (Cauchy-Schwarz on the two moving averages); far above that the state is not Adam's."""
    mean, std, second = _get(values, EXP_AVG_MEAN), _get(values, EXP_AVG_STD), _get(values, EXP_AVG_SQ_MEAN)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(mean * mean + std * std) / np.sqrt(np.maximum(second, 0.0))


def second_moment_collapsed(values, rules: AlertRules = AlertRules()):
    """True where Adam's second moment has fallen to where eps, not the gradient's scale, sets the step:
    sqrt(mean(exp_avg_sq)) < second_moment_floor while the first moment is not zero (a dead weight, whose moments
    are both zero, is not_moving's finding)."""
    mean, std, second = _get(values, EXP_AVG_MEAN), _get(values, EXP_AVG_STD), _get(values, EXP_AVG_SQ_MEAN)
    first = np.sqrt(mean * mean + std * std)
    return np.isfinite(second) & (np.sqrt(np.maximum(second, 0.0)) < rules.second_moment_floor) & (first > 0)


def _finite_positive(values) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    return values[np.isfinite(values) & (values > 0)]


def baseline_of(previous, rules: AlertRules = AlertRules()) -> float:
    """The spike baseline from a parameter's previous update norms (oldest first): the median of the finite,
    positive ones among the last spike_window, NaN while fewer than spike_min_history of them are known."""
    kept = _finite_positive(list(previous)[-rules.spike_window:])
    return float(np.median(kept)) if len(kept) >= rules.spike_min_history else math.nan


def spike_baselines(norms, rules: AlertRules = AlertRules()) -> np.ndarray:
    """baseline_of at every step of one parameter's update-norm column (in step order): element i is the baseline
    of the norms before i, computed for all steps at once (a sliding window). Equal to feeding the column step by
    step through NormHistory (tests/analyzer/test_findings.py)."""
    norms = np.asarray(norms, dtype=np.float64)
    out = np.full(len(norms), np.nan)
    if len(norms) <= rules.spike_min_history:
        return out
    kept = np.where(np.isfinite(norms) & (norms > 0), norms, np.nan)
    padded = np.concatenate([np.full(rules.spike_window, np.nan), kept[:-1]])  # element i's window ends at i - 1
    windows = np.lib.stride_tricks.sliding_window_view(padded, rules.spike_window)
    known = (~np.isnan(windows)).sum(axis=1)
    enough = known >= rules.spike_min_history
    if enough.any():
        out[enough] = np.nanmedian(windows[enough], axis=1)
    return out


class NormHistory:
    """Each parameter's last spike_window update norms, for the live check of one step at a time."""

    def __init__(self, rules: AlertRules = AlertRules()):
        self.rules = rules
        self._norms: dict[str, deque] = {}

    def baseline(self, name: str) -> float:
        return baseline_of(self._norms.get(name, ()), self.rules)

    def add(self, name: str, norm: float) -> None:
        self._norms.setdefault(name, deque(maxlen=self.rules.spike_window)).append(norm)


@dataclass(frozen=True)
class Alert:
    """One rule firing for one parameter at one step; value: the number that made it fire."""

    kind: str
    param: str
    step: int
    value: float

    def text(self) -> str:
        return f"step {self.step}: {self.param} {ALERT_WORDS[self.kind]} ({self.value:.3g})"


ALERT_WORDS = {OUT_OF_BAND: "update:data outside the band", NONFINITE: "NaN/Inf elements",
               NOT_MOVING: "stopped moving", UPDATE_SPIKE: "update-norm spike (x its median)",
               SECOND_MOMENT_COLLAPSE: "Adam second moment collapsed (sqrt of its mean)",
               EXP_AVG_RATIO: "exp_avg / sqrt(exp_avg_sq) exploding"}


def check_step(step: int, values: dict, history: NormHistory, weights=None) -> list[Alert]:
    """Every rule on one step's values ({param: {column: value}}), then the step's update norms added to the
    history. weights: the names the band rule judges (matrices and kernels; None: every parameter)."""
    rules = history.rules
    alerts = []
    for name, v in values.items():
        if float(nonfinite(v)) > 0:
            alerts.append(Alert(NONFINITE, name, step, float(nonfinite(v))))
        if (weights is None or name in weights) and int(out_of_band(v, rules)) != 0:
            alerts.append(Alert(OUT_OF_BAND, name, step, float(_get(v, UPDATE_TO_DATA))))
        if int(not_moving(v, rules)) != MOVING:
            alerts.append(Alert(NOT_MOVING, name, step, float(not_moving(v, rules))))
        factor = float(update_spike(v, history.baseline(name), rules))
        if factor:
            alerts.append(Alert(UPDATE_SPIKE, name, step, factor))
        if bool(second_moment_collapsed(v, rules)):
            alerts.append(Alert(SECOND_MOMENT_COLLAPSE, name, step,
                                float(np.sqrt(max(float(_get(v, EXP_AVG_SQ_MEAN)), 0.0)))))
        ratio = float(exp_avg_ratio(v))
        if math.isfinite(ratio) and ratio > rules.exp_avg_ratio_limit:
            alerts.append(Alert(EXP_AVG_RATIO, name, step, ratio))
        history.add(name, float(_get(v, UPDATE_NORM)))
    return alerts
