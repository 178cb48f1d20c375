"""Per-parameter health summary of the update:data ratio.

Karpathy's rule of thumb (makemore part 3): log10(std(update)/std(weight)) near -3 is healthy. Much higher (above
-1.5 by default) means each step rewrites a large fraction of the weight (lr too high or a badly scaled layer);
much lower (below -4.5) means the weight barely moves (lr too low, vanishing gradients, a dead layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..alert_rules import is_weight  # declared with the rules: the live alerts judge the same weights
from ..safe_text import text_table

SUMMARY_COLUMNS = ["optimizer", "param", "shape", "records", "latest_update_to_data", "median_update_to_data",
                   "latest_grad_to_data", "median_grad_to_data", "nonfinite_grad_steps", "first_nonfinite_step",
                   "status"]


FLAGGED_STATUSES = ("HIGH", "LOW")


@dataclass(frozen=True)
class Thresholds:
    """Bounds on the median update:data ratio (log10) outside which a weight is flagged."""

    high: float = -1.5
    low: float = -4.5
    target: float = -3.0

    def __post_init__(self):
        if not self.low < self.high:
            raise ValueError(f"low threshold ({self.low}) must be below high ({self.high})")


def status_of(median: float, shape, thresholds: Thresholds) -> str:
    if not is_weight(shape):
        return "n/a (not a weight)"
    if not np.isfinite(median):
        return "n/a (no finite ratio)"
    if median > thresholds.high:
        return "HIGH"
    if median < thresholds.low:
        return "LOW"
    return "ok"


def _finite_median(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if len(finite) else float("nan")


def _finite_last(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if len(finite) else float("nan")


def model_order_keys(params: pd.DataFrame, ratios: pd.DataFrame | None = None) -> list[tuple[int, str]]:
    """(optimizer, param) in model order: the order of ``run.params()`` (each optimizer's own order, which follows
    the model's), then any key only `ratios` has, in its order. Tables and plots all use it, whatever the source
    of the ratios (the statistics table lists parameters alphabetically)."""
    keys = list(dict.fromkeys(zip(params["optimizer"], params["param"])))
    if ratios is not None and len(ratios):
        seen = set(keys)
        keys += [k for k in dict.fromkeys(zip(ratios["optimizer"], ratios["param"])) if k not in seen]
    return keys


def summarize(ratios: pd.DataFrame, params: pd.DataFrame, thresholds: Thresholds = Thresholds()) -> pd.DataFrame:
    """One row per parameter, in model order: latest and median ratios over all records, NaN/Inf gradient steps,
    and a status (ok / HIGH / LOW / n/a) judged on the median update:data ratio."""
    shapes = {(r.optimizer, r.param): tuple(r.shape) for r in params.itertuples()}
    keys = model_order_keys(params, ratios)
    position = {k: i for i, k in enumerate(keys)}
    # Every parameter's rows together, in model order, each in record order (a stable sort: rows of one record, as
    # the statistics give them, keep their order): one pass of array slices, not a DataFrame per parameter.
    at = np.fromiter((position[k] for k in zip(ratios["optimizer"], ratios["param"])), np.int64, len(ratios))
    order = np.lexsort((ratios["record"].to_numpy(), at))
    at = at[order]
    column = {c: ratios[c].to_numpy()[order] for c in ("update_to_data", "grad_to_data", "grad_nonfinite", "step")}
    starts = np.flatnonzero(np.r_[True, at[1:] != at[:-1]]) if len(at) else np.zeros(0, np.int64)
    rows = []
    for lo, hi in zip(starts, [*starts[1:], len(at)]):
        opt, name = keys[at[lo]]
        u2d, g2d = column["update_to_data"][lo:hi], column["grad_to_data"][lo:hi]
        bad_steps = column["step"][lo:hi][column["grad_nonfinite"][lo:hi] > 0]
        median = _finite_median(u2d)
        shape = shapes.get((opt, name), ())
        rows.append({
            "optimizer": opt, "param": name, "shape": "x".join(map(str, shape)) or "scalar", "records": hi - lo,
            "latest_update_to_data": _finite_last(u2d), "median_update_to_data": median,
            "latest_grad_to_data": _finite_last(g2d), "median_grad_to_data": _finite_median(g2d),
            "nonfinite_grad_steps": len(bad_steps), "first_nonfinite_step": int(bad_steps.min()) if len(bad_steps)
            else None,
            "status": status_of(median, shape, thresholds),
        })
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


# The table's headers: the "latest" columns are the last recorded step's value (with a schedule decaying to 0 it
# can sit far from the median), so the header says so.
SUMMARY_HEADERS = {"latest_update_to_data": "update:data (last step)", "median_update_to_data": "update:data (median)",
                   "latest_grad_to_data": "grad:data (last step)", "median_grad_to_data": "grad:data (median)",
                   "nonfinite_grad_steps": "NaN/Inf steps", "first_nonfinite_step": "first"}
# The medians of the other update metrics analyze adds (analyzer/metrics.py), named for the table.
METRIC_MEDIAN_HEADERS = {"median_rms_update_to_data": "rms (median)",
                         "median_spectral_update_to_data": "spectral (median)"}
SUMMARY_HEADERS.update(METRIC_MEDIAN_HEADERS)


def format_summary(summary: pd.DataFrame, wide: bool = False) -> str:
    """The summary as an aligned text table, ratios to 2 decimals: update:data and grad:data at the last recorded
    step, each followed by its median over all records. Bounded: it fits 100 columns (names shortened, the columns
    after the update:data ones left out as needed) unless `wide` (upd.safe_text.text_table)."""
    if summary.empty:
        return "(no recorded parameters)"
    shown = summary.drop(columns=["optimizer"]) if summary["optimizer"].nunique() == 1 else summary
    shown = shown.copy()
    shown["first_nonfinite_step"] = shown["first_nonfinite_step"].map(lambda v: "-" if v is None or v != v
                                                                      else str(int(v)))
    shown = shown.rename(columns=SUMMARY_HEADERS)
    keep = ["optimizer", "param", SUMMARY_HEADERS["latest_update_to_data"], SUMMARY_HEADERS["median_update_to_data"],
            "status"]
    drop = ["records", "shape", SUMMARY_HEADERS["first_nonfinite_step"], SUMMARY_HEADERS["median_grad_to_data"],
            SUMMARY_HEADERS["latest_grad_to_data"]]  # the least telling first; NaN/Inf steps stays longest
    return text_table(shown, keep=keep, drop=drop, wide=wide)
