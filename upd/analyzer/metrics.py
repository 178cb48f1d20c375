"""The update metrics beside the std ratio: the RMS (relative Frobenius) ratio from the recorded norms, and the
spectral-norm ratio from the full-tensor records (definitions in upd/ratios.py, reasons in docs/diagnosis.md)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..ratios import RMS_UPDATE_TO_DATA, SPECTRAL_UPDATE_TO_DATA, UPDATE_TO_DATA, rms_update_to_data, \
    spectral_update_to_data_batch
from ..runfile import tensor_blocks
from ..runfile import schema
from ..torch_threads import one_torch_thread
from .summary import METRIC_MEDIAN_HEADERS, is_weight

METRICS = {"std": UPDATE_TO_DATA, "rms": RMS_UPDATE_TO_DATA, "spectral": SPECTRAL_UPDATE_TO_DATA}
METRIC_TITLES = {UPDATE_TO_DATA: "update:data ratio, log10(std(update) / std(weight))",
                 RMS_UPDATE_TO_DATA: "RMS update:data ratio, log10(||update||_F / ||weight||_F)",
                 SPECTRAL_UPDATE_TO_DATA: "spectral update:data ratio, log10(||update||_2 / ||weight||_2), "
                                          "full-tensor records"}
METRIC_COLUMNS = ["optimizer", "param", "step", UPDATE_TO_DATA, RMS_UPDATE_TO_DATA, SPECTRAL_UPDATE_TO_DATA]
# Spectral ratios of at most this many full records per weight (evenly spread): a few power iterations per record,
# each a pass over the weight, so a long run is sampled rather than read whole twice.
MAX_SPECTRAL_RECORDS = 64
# The records of one weight power-iterated together hold at most this many bytes (float64 before and after).
SPECTRAL_BATCH_BYTES = 64 * 1024 * 1024


def spread(count: int, limit: int) -> np.ndarray:
    """At most `limit` indexes of range(count), evenly spread, first and last included."""
    if count <= limit:
        return np.arange(count)
    return np.unique(np.linspace(0, count - 1, limit).round().astype(np.int64))


def spectral_rows(run, max_records: int = MAX_SPECTRAL_RECORDS) -> tuple[pd.DataFrame, list[str]]:
    """(optimizer, param, step, spectral_update_to_data) of every weight at (at most max_records of) its full
    records holding the parameter before and after the step, and the names of the weights left out because a whole
    matrix of theirs is larger than the analysis's block (tensor_blocks.BLOCK_ELEMENTS: power iteration needs the matrix
    in memory, and the analysis reads at most a block of a parameter at a time)."""
    rows, too_large = [], []
    with one_torch_thread():
        for opt in run.optimizers:
            for p in opt.param_records.values():
                if not is_weight(p.shape) or p.num_rows == 0 or not (
                        schema.KIND_PARAM in p.kinds and schema.KIND_PARAM_AFTER in p.kinds):
                    continue
                if p.numel > tensor_blocks.BLOCK_ELEMENTS:
                    too_large.append(p.name)
                    continue
                chosen = spread(p.num_rows, max_records)
                per_batch = max(1, SPECTRAL_BATCH_BYTES // (16 * max(1, p.numel)))  # before and after, float64
                for lo in range(0, len(chosen), per_batch):
                    batch = [int(r) for r in chosen[lo:lo + per_batch]]
                    before = torch.stack([p.read(schema.KIND_PARAM, slice(r, r + 1))[0] for r in batch])
                    after = torch.stack([p.read(schema.KIND_PARAM_AFTER, slice(r, r + 1))[0] for r in batch])
                    for r, ratio in zip(batch, spectral_update_to_data_batch(before, after)):
                        rows.append((opt.index, p.name, int(opt.steps[p.records[r]]), float(ratio)))
    return pd.DataFrame(rows, columns=["optimizer", "param", "step", SPECTRAL_UPDATE_TO_DATA]), too_large


def spectral_notes(too_large: list[str], spectral: pd.DataFrame, ratios: pd.DataFrame) -> list[str]:
    """What the reader should know about the spectral column: the steps its medians cover (full records only, where
    the std and RMS medians cover every step with statistics) and the weights without one."""
    notes = []
    spectral_steps, ratio_steps = spectral["step"].nunique(), ratios["step"].nunique() if len(ratios) else 0
    if 0 < spectral_steps < ratio_steps:
        notes.append(f"spectral medians over the {spectral_steps} step(s) with full-tensor records (it needs whole "
                     f"matrices); the std and rms medians over all {ratio_steps} steps")
    if too_large:
        notes.append(f"spectral ratio not computed for {len(too_large)} weight(s) over {tensor_blocks.BLOCK_ELEMENTS} "
                     f"elements (a whole matrix in memory): {', '.join(too_large[:4])}"
                     f"{' ...' if len(too_large) > 4 else ''}")
    return notes


def metrics_table(ratios: pd.DataFrame, spectral: pd.DataFrame) -> pd.DataFrame:
    """One row per (optimizer, param, step) of the ratio table: the std ratio, the RMS ratio, and the spectral ratio
    where a full record gave one (NaN elsewhere)."""
    table = ratios[["optimizer", "param", "step", UPDATE_TO_DATA]].assign(
        **{RMS_UPDATE_TO_DATA: rms_update_to_data(ratios["update_norm"].to_numpy(), ratios["param_norm"].to_numpy())})
    table = table.drop_duplicates(["optimizer", "param", "step"])
    table = table.merge(spectral, on=["optimizer", "param", "step"], how="left") if len(spectral) else \
        table.assign(**{SPECTRAL_UPDATE_TO_DATA: np.nan})
    return table[METRIC_COLUMNS].reset_index(drop=True)


def _finite_median(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else float("nan")


def with_metric_medians(summary: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """The summary with each parameter's median RMS and spectral ratios, inserted after the std ratio's median."""
    medians = {}
    for key, rows in metrics.groupby(["optimizer", "param"], sort=False):
        medians[(int(key[0]), key[1])] = (_finite_median(rows[RMS_UPDATE_TO_DATA]),
                                          _finite_median(rows[SPECTRAL_UPDATE_TO_DATA]))
    out = summary.copy()
    at = list(out.columns).index("median_update_to_data") + 1 if "median_update_to_data" in out.columns else len(
        out.columns)
    keys = list(zip(out["optimizer"], out["param"]))
    for i, name in enumerate(METRIC_MEDIAN_HEADERS):  # rms, then spectral
        out.insert(at + i, name, [medians.get(k, (np.nan, np.nan))[i] for k in keys])
    return out
