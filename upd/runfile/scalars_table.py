"""Reading the logged-scalars table (``schema.SCALARS_TABLE``: ``/optimizers/<k>/scalars``, see docs/format.md).

What ``rec.log(...)`` stored, the loss of ``step(closure)`` steps and the total gradient norms the recorder measures
are one row per optimizer step that logged something, kept apart from the record and statistics tables because
they exist at every step, also where neither table has a row. This module checks the table like validate.py checks
the others (a hostile file gets one RunFileError line, never a huge read) and turns it into a DataFrame.
"""
from __future__ import annotations

import h5py
import numpy as np
import pandas as pd

from . import schema
from .validate import Validator, is_list_of_str, link_type

# The columns of a scalars frame before the logged names.
KEY_COLUMNS = ["step", "wall_time"]


def scalars_frame(check: Validator, opt_group: h5py.Group, where: str) -> pd.DataFrame:
    """One optimizer's committed scalars: columns step, wall_time and one per logged name, one row per step in step
    order. Several rows of one step (a step logged again after a resume) merge into one, later values winning."""
    with check.reading(f"{where}: group '{schema.SCALARS}'"):
        if link_type(opt_group, schema.SCALARS) is None:  # the link itself: never follows it
            return pd.DataFrame(columns=KEY_COLUMNS)
    table = schema.SCALARS_TABLE
    group = check.child(opt_group, schema.SCALARS, f"{where}: group '{schema.SCALARS}'", h5py.Group)
    at = f"{where}: scalars table"
    step = check.declared(group, table.dataset(schema.STEP), f"{at} '{schema.STEP}'")
    n = int(step.shape[0])
    check.readable(step, n, f"{at} '{schema.STEP}'")
    found = {}
    for name in (schema.WALL_TIME, schema.VALUES):
        ds = found[name] = check.declared(group, table.dataset(name), f"{at} '{name}'")
        if ds.shape[0] < n:
            raise check.fail(f"{at} '{name}'", f"has {ds.shape[0]} rows, fewer than the {n} committed rows")
        check.readable(ds, n, f"{at} '{name}'")
    columns = check.json_attr(group, schema.SCALAR_COLUMNS, at, list)
    if not is_list_of_str(columns) or len(set(columns)) < len(columns):
        raise check.fail(at, f"attribute '{schema.SCALAR_COLUMNS}' must be a JSON list of distinct names")
    values_ds = found[schema.VALUES]
    if len(columns) < values_ds.shape[1]:
        raise check.fail(at, f"'{schema.VALUES}' has {values_ds.shape[1]} columns but attribute "
                             f"'{schema.SCALAR_COLUMNS}' names {len(columns)}")
    clash = set(columns) & set(KEY_COLUMNS)
    if clash:
        raise check.fail(at, f"attribute '{schema.SCALAR_COLUMNS}' names {sorted(clash)}, which are the table's keys")
    with check.reading(at):
        steps = step[:n].astype(np.int64, copy=False)
        wall = found[schema.WALL_TIME][:n].astype(np.float64, copy=False)
        values = np.full((n, len(columns)), np.nan)
        if n and values_ds.shape[1]:
            values[:, : values_ds.shape[1]] = values_ds[:n]
    frame = pd.DataFrame(values, columns=columns)
    frame.insert(0, "step", steps)
    frame.insert(1, "wall_time", wall)
    if n and np.unique(steps).size < n:
        # groupby().last() takes each column's last non-NaN value: a value logged again replaces the earlier one
        frame = frame.groupby("step", sort=True, as_index=False).last()
    else:
        frame = frame.sort_values("step", kind="stable").reset_index(drop=True)
    return frame
