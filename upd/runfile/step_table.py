"""What each recorded step has, for every kind of run: one table over the record table and the statistics table.

A step can have a full record (``records/``), a statistics row (``stats/``), both, or neither (the scalars table
alone, joined by ``reader.steps_table``). Both tables store the step, its backward-pass count, its wall time and the
lr of each param group, so a statistics-only run and a full run answer ``run.steps()`` alike: one row per step, with
``record`` and ``stats_row`` saying which rows of the two tables it has (<NA> where none). A Run's optimizer and a
Job's (its aligned rows) go through the same function.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

KEY_COLUMNS = ["optimizer", "record", "stats_row", "step", "backward_pass", "wall_time"]


def _where(steps: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each of `wanted`, the position of its last occurrence in `steps`, or -1."""
    if not len(steps):
        return np.full(len(wanted), -1, np.int64)
    order = np.argsort(steps, kind="stable")
    sorted_steps = steps[order]
    at = np.searchsorted(sorted_steps, wanted, side="right") - 1
    found = (at >= 0) & (sorted_steps[np.clip(at, 0, None)] == wanted)
    return np.where(found, order[np.clip(at, 0, None)], -1)


def step_frame(index: int, records, stats) -> pd.DataFrame:
    """One row per step with a record or a statistics row, in step order (a table's own order among equal steps).

    records: (steps, backward_passes, wall_times, learning_rates) of the committed records; stats: the same of the
    committed statistics rows. A step with both reads its values from the record (the two agree)."""
    r_steps, r_backward, r_wall, r_lr = (np.asarray(a) for a in records)
    s_steps, s_backward, s_wall, s_lr = (np.asarray(a) for a in stats)
    groups = max(r_lr.shape[1] if r_lr.ndim == 2 else 0, s_lr.shape[1] if s_lr.ndim == 2 else 0)
    alone = _where(r_steps, s_steps) < 0  # statistics rows whose step has no record
    stats_of_record = _where(s_steps, r_steps)
    lr = np.full((len(r_steps) + int(alone.sum()), groups), np.nan)
    if r_lr.ndim == 2:
        lr[:len(r_steps), :r_lr.shape[1]] = r_lr
    if s_lr.ndim == 2:
        lr[len(r_steps):, :s_lr.shape[1]] = s_lr[alone]
    table = pd.DataFrame({
        "optimizer": index,
        "record": np.concatenate([np.arange(len(r_steps)), np.full(int(alone.sum()), -1)]),
        "stats_row": np.concatenate([stats_of_record, np.nonzero(alone)[0]]),
        "step": np.concatenate([r_steps, s_steps[alone]]).astype(np.int64),
        "backward_pass": np.concatenate([r_backward, s_backward[alone]]).astype(np.int64),
        "wall_time": np.concatenate([r_wall, s_wall[alone]]).astype(np.float64),
    })
    for g in range(groups):
        table[f"lr_group{g}"] = lr[:, g]
    table = table.sort_values("step", kind="stable").reset_index(drop=True)
    for column in ("record", "stats_row"):
        values = table[column].to_numpy()
        if (values < 0).any():
            table[column] = pd.array(np.where(values < 0, 0, values), dtype="Int64")
            table.loc[values < 0, column] = pd.NA
    return table


def model_order(entries: list[dict]) -> list[dict]:
    """Parameter entries (each with "group" and "index_in_group", None counting as 0) in the optimizer's order: the
    order of the model's parameters within each group (HDF5 and JSON objects list names alphabetically)."""
    def number(value) -> int:  # a file's text: anything but an int sorts as 0
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def key(item):
        position, entry = item
        return (number(entry.get("group")), number(entry.get("index_in_group")), position)
    return [entry for _, entry in sorted(enumerate(entries), key=key)]
