"""The per-step statistics table (``schema.STATS_TABLE``: ``/optimizers/<k>/stats``, see docs/format.md): writing
its rows in blocks, and reading it.

Writing is on the path of every statistics step, so ``StatsTableWriter`` keeps what reopening would cost at every
row: the datasets' handles, the parameter and column index, and the JSON attributes, rewritten only when a parameter
or a column appears. It writes any number of rows with one write per dataset, which is what lets the writer commit
statistics-only steps in batches (``AsyncRunWriter``): 6.7 ms per row one at a time on a 29-parameter model,
most of it per-dataset overhead and flushes, not bytes.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import h5py
import numpy as np
import pandas as pd

from . import encoding, schema
from .datasets import create_dataset, create_declared
from .step_table import model_order

STATS_BLOCK_ROWS = 1024  # rows of the (steps, params, columns) table read at once
VALUES_DTYPE = np.dtype(schema.STATS_TABLE.dataset(schema.VALUES).dtype)


class StatsRows(Mapping):
    """One step's statistics as the recorder computes them: a (parameters, columns) table, `names` and `columns`
    its labels. Reads as ``{name: {column: value}}`` (a ``Record.stats``), each parameter's dict made when asked
    for; the writer copies the table into the run as it is. Building a dict per parameter at every step cost the
    training thread, and unpacking them the writer thread, more than the statistics' numbers themselves on a small
    model. `names` is the same list object from step to step while the parameters stay the same: the writer keeps
    its positions in the file by its identity.

    The table is either given, or made where it is first read from `numbers` (a 1-D float64 array, numbers already
    on the host) by `maker`, an object whose ``tables(numbers)`` turns a (steps, n) stack of such arrays into their
    (steps, parameters, columns) tables: the recorder hands the raw sums and norms of a step over, and the writer
    thread makes the tables of the rows it writes together with one call (``fill_tables``), off the training
    thread, at a fraction of the cost of one call per row."""

    __slots__ = ("names", "columns", "_table", "maker", "numbers", "_index")

    def __init__(self, names: list, columns: tuple, table: np.ndarray | None = None, *, maker=None,
                 numbers: np.ndarray | None = None):
        self.names = names
        self.columns = columns
        self._table = table
        self.maker = maker
        self.numbers = numbers
        self._index = None

    @property
    def table(self) -> np.ndarray:
        if self._table is None:
            fill_tables([self])
        return self._table

    def _position(self, name) -> int:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        return self._index[name]

    def __getitem__(self, name) -> dict:
        return dict(zip(self.columns, self.table[self._position(name)].tolist()))

    def __contains__(self, name) -> bool:
        try:
            self._position(name)
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"<StatsRows {len(self.names)} parameters x {len(self.columns)} columns>"


def fill_tables(rows: list) -> None:
    """Make the tables of these StatsRows not made yet, one ``maker.tables`` call per run of rows that share a
    maker (consecutive steps of one optimizer, the usual batch)."""
    pending = [r for r in rows if isinstance(r, StatsRows) and r._table is None]
    for _, run in itertools.groupby(pending, key=lambda r: id(r.maker)):
        run = list(run)
        tables = run[0].maker.tables(np.stack([r.numbers for r in run]))
        for r, table in zip(run, tables):
            r._table, r.maker, r.numbers = table, None, None


def _write_rows(ds: h5py.Dataset, start: int, rows: np.ndarray) -> None:
    """rows (already in the dataset's dtype, C order) at `start` along the first axis, through the low-level API:
    h5py's slicing cost about 0.17 ms per call in selection bookkeeping, several times the write."""
    file_space = ds.id.get_space()
    file_space.select_hyperslab((start,) + (0,) * (rows.ndim - 1), rows.shape)
    ds.id.write(h5py.h5s.create_simple(rows.shape), file_space, rows)


class StatsTableWriter:
    """Appends rows to one optimizer's statistics table; ``write(recs)`` writes their rows (uncommitted),
    ``commit(recs)`` then appends their steps: the commit protocol's two halves (writer.py flushes in between)."""

    def __init__(self, optimizer_group: h5py.Group, create_group=None):
        """create_group(parent, name): how the writer creates the table's group when it has none yet (hidden from
        readers until the first rows' commit); default: linked at once."""
        if schema.STATS not in optimizer_group:
            st = (create_group or h5py.Group.create_group)(optimizer_group, schema.STATS)
            create_declared(st, schema.STATS_TABLE)  # values: at the first row, when its width is known
            st.attrs[schema.STATS_PARAMS] = encoding.to_json([])
            st.attrs[schema.STATS_COLUMNS] = encoding.to_json([])
            st.attrs[schema.STATS_PARAM_META] = encoding.to_json({})
        else:
            st = optimizer_group[schema.STATS]
        self.group = st
        self.params = list(encoding.from_json(st.attrs[schema.STATS_PARAMS]))
        self.columns = list(encoding.from_json(st.attrs[schema.STATS_COLUMNS]))
        self.param_index = {n: i for i, n in enumerate(self.params)}
        self.column_index = {c: i for i, c in enumerate(self.columns)}
        self.step = st[schema.COMMIT_COLUMN]
        self.backward_pass = st[schema.BACKWARD_PASS]
        self.wall_time = st[schema.WALL_TIME]
        self.lr = st[schema.LR]
        self.hparams = st[schema.HPARAMS]
        self._last_hparams: str | None = None  # the last row's hparams text this writer wrote (rows store changes)
        self._last_hparams_value: list | None = None  # the hparams that text was made of
        self.values = st[schema.VALUES] if schema.VALUES in st else None
        self._positions: dict[tuple, list] = {}  # a row's column names -> their positions in the table
        # The datasets' shapes, kept here: asking h5py for a shape is an HDF5 call each time. This writer is the only
        # one that changes them (attribute name -> shape).
        self._shapes = {key: list(getattr(self, key).shape)
                        for key in ("step", "backward_pass", "wall_time", "lr", "hparams")}
        if self.values is not None:
            self._shapes["values"] = list(self.values.shape)
        self._known_table = None  # (names, columns, row positions, column positions) of the last StatsRows written

    def _resize(self, key: str, shape: list) -> None:
        getattr(self, key).id.set_extent(tuple(shape))
        self._shapes[key] = list(shape)

    def _extend(self, key: str, stop: int) -> None:
        """Grow the dataset `self.<key>` along the step axis to at least `stop` rows."""
        shape = self._shapes[key]
        if shape[0] < stop:
            self._resize(key, [stop] + shape[1:])

    def _table_positions(self, stats: StatsRows):
        """Where a StatsRows' rows and columns go in the table: a pair of slices when they are the table's first
        parameters and columns in order (the usual case), else index lists; kept while its names and columns stay."""
        known = self._known_table
        if known is not None and known[0] is stats.names and known[1] is stats.columns:
            return known[2], known[3]
        rows = [self.param_index[name] for name in stats.names]
        where = [self.column_index[c] for c in stats.columns]
        rows = slice(0, len(rows)) if rows == list(range(len(rows))) else rows
        where = slice(0, len(where)) if where == list(range(len(where))) else where
        if not (isinstance(rows, slice) and isinstance(where, slice)):  # made once: np.ix_ cost a row 8 us
            rows, where = np.ix_(np.arange(len(self.params))[rows], np.arange(len(self.columns))[where])
        self._known_table = (stats.names, stats.columns, rows, where)
        return rows, where

    def _knows(self, stats) -> bool:
        """Every parameter and column of this StatsRows is in the index already (one identity check)."""
        known = self._known_table
        return isinstance(stats, StatsRows) and known is not None and known[0] is stats.names \
            and known[1] is stats.columns

    def _grow(self, recs: list) -> None:
        """Add the parameters and columns these records bring, to the index, the attributes and the dataset."""
        new_params = []
        new_columns = False
        for rec in recs:
            if self._knows(rec.stats):
                continue
            if isinstance(rec.stats, StatsRows):  # its columns are every parameter's
                for c in rec.stats.columns:
                    if c not in self.column_index:
                        self.column_index[c] = len(self.columns)
                        self.columns.append(c)
                        new_columns = True
                for name in rec.stats.names:
                    if name not in self.param_index:
                        self.param_index[name] = len(self.params)
                        self.params.append(name)
                        new_params.append((name, rec.stats_meta.get(name, {})))
                continue
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
            # Chunks of up to 64 steps, at most 512 KiB: appends stay in HDF5's default 1 MiB chunk cache until the
            # chunk is full, and a 10,000-step table loads in a few dozen reads.
            decl = schema.STATS_TABLE.dataset(schema.VALUES)
            row_bytes = max(1, len(self.params)) * max(1, len(self.columns)) * np.dtype(decl.dtype).itemsize
            rows = int(min(64, max(1, (512 << 10) // row_bytes)))
            self.values = create_dataset(st, decl, shape=(0, len(self.params), len(self.columns)),
                                  chunks=(rows, max(1, len(self.params)), max(1, len(self.columns))))
            self._shapes["values"] = [0, len(self.params), len(self.columns)]
        elif self._shapes["values"][1] < len(self.params) or self._shapes["values"][2] < len(self.columns):
            self._resize("values", [self._shapes["values"][0], len(self.params), len(self.columns)])

    def write(self, recs: list) -> None:
        """The rows of these statistics records (of this optimizer, in step order), after the committed ones."""
        fill_tables([rec.stats for rec in recs])
        self._grow(recs)
        start = self._shapes["step"][0]
        stop = start + len(recs)
        block = np.full((len(recs), len(self.params), len(self.columns)), np.nan, dtype=VALUES_DTYPE)
        k = 0
        while k < len(recs):
            stats = recs[k].stats
            if isinstance(stats, StatsRows):
                # a run of rows laid out alike (the usual batch: all of them) goes in with one assignment
                end = k + 1
                while end < len(recs) and isinstance(recs[end].stats, StatsRows) and \
                        recs[end].stats.names is stats.names and recs[end].stats.columns is stats.columns:
                    end += 1
                rows, where = self._table_positions(stats)
                block[k:end][:, rows, where] = np.stack([rec.stats.table for rec in recs[k:end]])
                k = end
                continue
            rec, row = recs[k], block[k]  # a {name: {column: value}} row (full statistics sets)
            k += 1
            rows = [self.param_index[name] for name in rec.stats]
            keys = [tuple(values) for values in rec.stats.values()]
            if keys and all(key == keys[0] for key in keys):  # the usual row: every parameter the same columns
                where = self._positions.get(keys[0])
                if where is None:
                    where = self._positions[keys[0]] = [self.column_index[c] for c in keys[0]]
                row[np.ix_(rows, where)] = [list(values.values()) for values in rec.stats.values()]
                continue
            for r, key, values in zip(rows, keys, rec.stats.values()):
                where = self._positions.get(key)
                if where is None:
                    where = self._positions[key] = [self.column_index[c] for c in key]
                row[r, where] = list(values.values())
        groups = max(len(rec.hparams) for rec in recs)
        if self._shapes["lr"][1] < groups:  # the group axis grows with add_param_group, NaN before a group existed
            self._resize("lr", [self._shapes["lr"][0], groups])
        lr = np.full((len(recs), self._shapes["lr"][1]), np.nan)
        for k, rec in enumerate(recs):
            lr[k, :len(rec.hparams)] = [encoding.lr_of(g) for g in rec.hparams]
        wall_time = np.array([rec.wall_time for rec in recs], dtype=np.float64)
        backward_pass = np.array([rec.backward_pass for rec in recs], dtype=np.int64)
        for key, rows in (("values", block), ("wall_time", wall_time), ("lr", lr), ("backward_pass", backward_pass)):
            self._extend(key, stop)
            _write_rows(getattr(self, key), start, rows)
        texts = []
        for rec in recs:
            if rec.hparams == self._last_hparams_value:  # the usual row: no JSON to write, none to make
                texts.append("")
                continue
            text = hparams_text(rec.hparams)
            texts.append("" if text == self._last_hparams else text)
            self._last_hparams, self._last_hparams_value = text, rec.hparams
        self._extend("hparams", stop)
        self.hparams[start:stop] = texts  # strings: through h5py (a few per batch, most of them empty)

    def commit(self, recs: list) -> None:
        """Append the records' steps: their rows exist for readers from now on."""
        start = self._shapes["step"][0]
        self._extend("step", start + len(recs))
        _write_rows(self.step, start, np.array([rec.step for rec in recs], dtype=np.int64))


def hparams_text(hparams: list) -> str:
    """A statistics row's ``hparams``: the param groups' hyperparameters without lr (the ``lr`` column holds it)."""
    return encoding.to_json([{k: v for k, v in group.items() if k != "lr"} for group in hparams])


def hparams_rows(texts: list, lr: np.ndarray) -> list:
    """Each row's param groups (JSON-decoded, lr from its ``lr`` column) from the ``hparams`` texts of consecutive
    rows, "" meaning the row before's; None for a row whose groups are unknown (no text before it), or whose text is
    not a JSON list of objects."""
    out, groups = [], None
    for row, text in enumerate(texts):
        if text:
            try:
                groups = encoding.from_json(text)
            except ValueError:
                groups = None
            if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
                groups = None
        if groups is None:
            out.append(None)
            continue
        with_lr = [dict(g) for g in groups]
        for g, group in enumerate(with_lr):
            if g < lr.shape[1] and not np.isnan(lr[row, g]):
                group["lr"] = float(lr[row, g])
        out.append(with_lr)
    return out


def has_stats(opt) -> bool:
    group = opt._group
    return schema.STATS in group and schema.VALUES in group[schema.STATS]


def committed_stats_rows(opt) -> int:
    return int(opt._group[schema.STATS][schema.COMMIT_COLUMN].shape[0]) if has_stats(opt) else 0


def stats_param_meta(opt) -> dict:
    """{name: {shape, dtype, group, index_in_group}} of the parameters in the statistics table, as the reader parsed
    and checked it when the file was opened (not to be changed: the reader's own)."""
    return opt.stats_table_steps.param_meta


STATE_PREFIX = "state."  # statistic columns of optimizer state: state.<key>_<stat>


def stats_state_keys(opt) -> list[str]:
    """The optimizer state keys the statistics table has columns of (``state.<key>_<stat>``), in column order."""
    keys = []
    for column in opt.stats_table_steps.columns:
        if isinstance(column, str) and column.startswith(STATE_PREFIX):
            rest = column[len(STATE_PREFIX):]
            key = rest[:-len("_zero_frac")] if rest.endswith("_zero_frac") else rest.rpartition("_")[0]
            if key and key not in keys:
                keys.append(key)
    return keys


def _iter_stats(opt):
    """Yield (steps, lr, values block, params, columns) over the committed rows, a block at a time."""
    st = opt._group[schema.STATS]
    n = committed_stats_rows(opt)
    params, columns = opt.stats_table_steps.params, opt.stats_table_steps.columns
    steps = st[schema.STEP][:n]
    lr = st[schema.LR][:n] if st[schema.LR].shape[0] >= n else np.full((n, 0), np.nan)
    values = st[schema.VALUES]
    for start in range(0, n, STATS_BLOCK_ROWS):
        stop = min(n, start + STATS_BLOCK_ROWS)
        block = values[start:stop]
        yield steps[start:stop], lr[start:stop], block, params[: block.shape[1]], columns[: block.shape[2]]


def stats_frame(run) -> pd.DataFrame:
    """Tidy table: one row per (optimizer, param, step) with every recorded statistic as a column.

    Built from whole arrays, one DataFrame per optimizer: a frame per parameter and four column inserts each took
    68 s for 5,000 names (and ran out of memory at 20,000); the cost is now that of the values read."""
    frames = []
    for opt in run.optimizers:
        if not has_stats(opt):
            continue
        meta = stats_param_meta(opt)
        parts = []
        columns = None
        for steps, lr, block, params, block_columns in _iter_stats(opt):
            columns = block_columns
            names = np.empty(len(params), dtype=object)
            names[:] = params
            groups = np.array([(meta.get(name) or {}).get("group") or 0 if isinstance(meta.get(name), dict) else 0
                               for name in params], dtype=np.int64)
            by_param = block.transpose(1, 0, 2)  # (params, steps, columns): rows come out per parameter, then step
            present = ~np.all(np.isnan(by_param), axis=2)  # the parameter had no gradient at that step
            param_at, step_at = np.nonzero(present)
            group_at = groups[param_at]
            has_lr = lr.ndim == 2 and lr.shape[1] > 0
            lr_at = np.full(len(param_at), np.nan)
            if has_lr:
                known = group_at < lr.shape[1]
                lr_at[known] = lr[step_at[known], group_at[known]]
            parts.append((names[param_at], steps[step_at], lr_at, by_param[present].astype(np.float64)))
        if not parts:
            continue
        values = np.concatenate([p[3] for p in parts]) if len(parts) > 1 else parts[0][3]
        data = {"optimizer": np.full(len(values), opt.index, dtype=np.int64),
                "param": np.concatenate([p[0] for p in parts]),
                "step": np.concatenate([p[1] for p in parts]),
                "lr": np.concatenate([p[2] for p in parts])}
        data.update({c: values[:, i] for i, c in enumerate(columns) if c not in data})
        frames.append(pd.DataFrame(data))
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=["optimizer", "param", "step", "lr"])
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    return in_model_order(out, {opt.index: stats_param_meta(opt) for opt in run.optimizers if has_stats(opt)})


def in_model_order(table: pd.DataFrame, metas: dict) -> pd.DataFrame:
    """Rows of (optimizer, param, step) sorted by optimizer, the parameter's place in the model (its param group and
    index in it, ``metas``: {optimizer: {name: meta}}), then step; a parameter without metadata after the others."""
    position = {}
    for index, by_name in metas.items():
        ordered = model_order([{"name": name, **meta} for name, meta in by_name.items() if isinstance(meta, dict)])
        position.update({(index, entry["name"]): i for i, entry in enumerate(ordered)})
    place = [position.get(key, len(position)) for key in zip(table["optimizer"], table["param"])]
    # names sort by their codes in sorted order (pd.factorize), never by a fixed-width '<U{longest}' copy of the
    # column: that costs rows x the longest name x 4 bytes, and a file's names may be 1 MB
    names = pd.factorize(table["param"], sort=True)[0]
    order = np.lexsort((table["step"].to_numpy(), names, np.asarray(place), table["optimizer"].to_numpy()))
    return table.iloc[order].reset_index(drop=True)
