"""The per-step statistics table (``schema.STATS_TABLE``: ``/optimizers/<k>/stats``, see docs/format.md): writing
its rows in blocks, and reading it.

Writing is on the path of every statistics step, so ``StatsTableWriter`` keeps what reopening would cost at every
row: the datasets' handles, the parameter and column index, and the JSON attributes, rewritten only when a parameter
or a column appears. It writes any number of rows with one write per dataset, which is what lets the writer commit
statistics-only steps in batches (``AsyncRunWriter``): 6.7 ms per row one at a time on a 29-parameter model,
most of it per-dataset overhead and flushes, not bytes.
"""
from __future__ import annotations

import h5py
import numpy as np
import pandas as pd

from . import encoding, schema

STATS_BLOCK_ROWS = 1024  # rows of the (steps, params, columns) table read at once


class StatsTableWriter:
    """Appends rows to one optimizer's statistics table; ``write(recs)`` writes their rows (uncommitted),
    ``commit(recs)`` then appends their steps: the commit protocol's two halves (writer.py flushes in between)."""

    def __init__(self, optimizer_group: h5py.Group):
        from .writer import _create_declared  # writer.py imports this module

        if schema.STATS not in optimizer_group:
            st = optimizer_group.create_group(schema.STATS)
            _create_declared(st, schema.STATS_TABLE)  # values: at the first row, when its width is known
            st.attrs[schema.STATS_PARAMS] = encoding.to_json([])
            st.attrs[schema.STATS_COLUMNS] = encoding.to_json([])
            st.attrs[schema.STATS_PARAM_META] = encoding.to_json({})
        self.group = st = optimizer_group[schema.STATS]
        self.params = list(encoding.from_json(st.attrs[schema.STATS_PARAMS]))
        self.columns = list(encoding.from_json(st.attrs[schema.STATS_COLUMNS]))
        self.param_index = {n: i for i, n in enumerate(self.params)}
        self.column_index = {c: i for i, c in enumerate(self.columns)}
        self.step = st[schema.COMMIT_COLUMN]
        self.wall_time = st[schema.WALL_TIME]
        self.lr = st[schema.LR]
        self.values = st[schema.VALUES] if schema.VALUES in st else None
        self._positions: dict[tuple, list] = {}  # a row's column names -> their positions in the table

    def _grow(self, recs: list) -> None:
        """Add the parameters and columns these records bring, to the index, the attributes and the dataset."""
        new_params = []
        new_columns = False
        for rec in recs:
            for name, values in rec.stats.items():
                if name not in self.param_index:
                    self.param_index[name] = len(self.params)
                    self.params.append(name)
                    new_params.append((name, rec.stats_meta.get(name, {})))
                if values.keys() <= self.column_index.keys():  # the usual row: one set comparison, in C
                    continue
                for c in values:
                    if c not in self.column_index:
                        self.column_index[c] = len(self.columns)
                        self.columns.append(c)
                        new_columns = True
        if not (new_params or new_columns):
            return
        st = self.group
        st.attrs[schema.STATS_PARAMS] = encoding.to_json(self.params)
        st.attrs[schema.STATS_COLUMNS] = encoding.to_json(self.columns)
        if new_params:
            meta = encoding.from_json(st.attrs[schema.STATS_PARAM_META])
            meta.update(dict(new_params))
            st.attrs[schema.STATS_PARAM_META] = encoding.to_json(meta)
        if self.values is None:
            from .writer import _create

            # Chunks of up to 64 steps, at most 512 KiB: appends stay in HDF5's default 1 MiB chunk cache until the
            # chunk is full, and a 10,000-step table loads in a few dozen reads.
            decl = schema.STATS_TABLE.dataset(schema.VALUES)
            row_bytes = max(1, len(self.params)) * max(1, len(self.columns)) * np.dtype(decl.dtype).itemsize
            rows = int(min(64, max(1, (512 << 10) // row_bytes)))
            self.values = _create(st, decl, shape=(0, len(self.params), len(self.columns)),
                                  chunks=(rows, max(1, len(self.params)), max(1, len(self.columns))))
        elif self.values.shape[1] < len(self.params) or self.values.shape[2] < len(self.columns):
            self.values.resize((self.values.shape[0], len(self.params), len(self.columns)))

    def write(self, recs: list) -> None:
        """The rows of these statistics records (of this optimizer, in step order), after the committed ones."""
        self._grow(recs)
        start = self.step.shape[0]
        stop = start + len(recs)
        block = np.full((len(recs), len(self.params), len(self.columns)), np.nan, dtype=self.values.dtype)
        for k, rec in enumerate(recs):
            rows = [self.param_index[name] for name in rec.stats]
            keys = [tuple(values) for values in rec.stats.values()]
            if keys and all(key == keys[0] for key in keys):  # the usual row: every parameter the same columns
                where = self._positions.get(keys[0])
                if where is None:
                    where = self._positions[keys[0]] = [self.column_index[c] for c in keys[0]]
                block[k][np.ix_(rows, where)] = [list(values.values()) for values in rec.stats.values()]
                continue
            for r, key, values in zip(rows, keys, rec.stats.values()):
                where = self._positions.get(key)
                if where is None:
                    where = self._positions[key] = [self.column_index[c] for c in key]
                block[k, r, where] = list(values.values())
        groups = max(len(rec.hparams) for rec in recs)
        if self.lr.shape[1] < groups:  # the group axis grows with add_param_group, NaN before a group existed
            self.lr.resize(groups, axis=1)
        lr = np.full((len(recs), self.lr.shape[1]), np.nan)
        for k, rec in enumerate(recs):
            lr[k, :len(rec.hparams)] = [encoding.lr_of(g) for g in rec.hparams]
        for ds, rows in ((self.values, block), (self.wall_time, [rec.wall_time for rec in recs]), (self.lr, lr)):
            if ds.shape[0] < stop:
                ds.resize(stop, axis=0)
            ds[start:stop] = rows

    def commit(self, recs: list) -> None:
        """Append the records' steps: their rows exist for readers from now on."""
        start = self.step.shape[0]
        self.step.resize(start + len(recs), axis=0)
        self.step[start:] = [rec.step for rec in recs]


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
