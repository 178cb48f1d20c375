"""Reading the per-step statistics table (``schema.STATS_TABLE``: ``/optimizers/<k>/stats``, see docs/format.md)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import encoding, schema

STATS_BLOCK_ROWS = 1024  # rows of the (steps, params, columns) table read at once


def has_stats(opt) -> bool:
    group = opt._group
    return schema.STATS in group and schema.VALUES in group[schema.STATS]


def committed_stats_rows(opt) -> int:
    return int(opt._group[schema.STATS][schema.COMMIT_COLUMN].shape[0]) if has_stats(opt) else 0


def stats_param_meta(opt) -> dict:
    """{name: {shape, dtype, group, index_in_group}} of the parameters in the statistics table."""
    if not has_stats(opt):
        return {}
    return dict(encoding.from_json(opt._group[schema.STATS].attrs.get(schema.STATS_PARAM_META, "{}")))


def _iter_stats(opt):
    """Yield (steps, lr, values block, params, columns) over the committed rows, a block at a time."""
    st = opt._group[schema.STATS]
    n = committed_stats_rows(opt)
    params = list(encoding.from_json(st.attrs[schema.STATS_PARAMS]))
    columns = list(encoding.from_json(st.attrs[schema.STATS_COLUMNS]))
    steps = st[schema.STEP][:n]
    lr = st[schema.LR][:n] if st[schema.LR].shape[0] >= n else np.full((n, 0), np.nan)
    values = st[schema.VALUES]
    for start in range(0, n, STATS_BLOCK_ROWS):
        stop = min(n, start + STATS_BLOCK_ROWS)
        block = values[start:stop]
        yield steps[start:stop], lr[start:stop], block, params[: block.shape[1]], columns[: block.shape[2]]


def stats_frame(run) -> pd.DataFrame:
    """Tidy table: one row per (optimizer, param, step) with every recorded statistic as a column."""
    frames = []
    for opt in run.optimizers:
        if not has_stats(opt):
            continue
        groups = {name: meta.get("group") or 0 for name, meta in stats_param_meta(opt).items()}
        for steps, lr, block, params, columns in _iter_stats(opt):
            for j, name in enumerate(params):
                values = block[:, j, :]
                present = ~np.all(np.isnan(values), axis=1)  # the parameter had no gradient at that step
                if not present.any():
                    continue
                df = pd.DataFrame(values[present].astype(np.float64), columns=columns)
                g = groups.get(name, 0)
                df.insert(0, "optimizer", opt.index)
                df.insert(1, "param", name)
                df.insert(2, "step", steps[present])
                df.insert(3, "lr", lr[present, g] if lr.ndim == 2 and g < lr.shape[1] else np.nan)
                frames.append(df)
    if not frames:
        return pd.DataFrame(columns=["optimizer", "param", "step", "lr"])
    out = pd.concat(frames, ignore_index=True)
    return out.sort_values(["optimizer", "param", "step"], kind="stable").reset_index(drop=True)
