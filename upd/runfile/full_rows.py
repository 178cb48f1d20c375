"""Full records' rows, appended through dataset handles kept open from one record to the next.

A full record of a model with P parameters appends one row to about 8 datasets per parameter (param, grad,
param_after, each state tensor, state_present, record_index) and to the record table. Through h5py's high-level
objects each row cost a group lookup (``grp[name]``, itself an object open), a shape query, a resize that checks the
creation properties, and a selection built in Python: on a 6-parameter model about 52 ms of CPU per record on a
busy machine, whatever the record's size, against 1-3 ms for ``numpy.tofile`` of the same bytes; 6-10 ms this way
(docs/performance.md, "Full records at every step"). Here every dataset
is looked up once, its row count and row shape are kept, and a row is one ``set_extent`` and one write: a
``write_direct_chunk`` of the tensor's own bytes where the dataset holds one uncompressed chunk per row (no
selection, no conversion, no chunk-cache copy), else a low-level write of a one-row hyperslab. Several records
written with one commit (the writer thread takes the full records queued behind the one it writes) grow each
dataset once, and their small rows (record index, state mask, 0-d state, the record table) are one write per
dataset: the number of HDF5 calls per record, not the bytes, is what a small record costs.

The logged-scalars table, written with every record that carries scalars, is kept the same way (``ScalarRows``).

The kept row counts are the writer's own: nothing else writes the file while it is open, and a resumed run's
counts are read when a dataset is first used, after ``RunWriter`` dropped uncommitted rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import h5py
import numpy as np
from h5py import h5s, h5t

from . import encoding, schema

if TYPE_CHECKING:
    import torch

    from .record import ParamSnapshot, Record

class Rows:
    """A dataset the writer appends to row by row: its handle, row count and row shape, read once."""

    __slots__ = ("ds", "id", "rows", "row_shape", "dtype", "stored_as", "direct", "_origin", "_memory", "_mtype",
                 "_fspace")

    def __init__(self, ds: h5py.Dataset):
        self.ds = ds
        self.id = ds.id  # the low-level handle, kept: ds.id is a property call per use
        self._fspace = self.id.get_space()  # the file's dataspace, made again only when the extent changes
        shape = ds.shape
        self.rows = shape[0]
        self.row_shape = tuple(shape[1:])
        self.dtype = ds.dtype
        self._mtype = h5t.py_create(self.dtype)  # text: Python objects, which h5py converts to variable-length strings
        self._shape_rows()
        # A tensor dataset (it names the torch dtype its values encode): one uncompressed chunk per row takes a
        # tensor's bytes as they are.
        self.stored_as = ds.attrs[schema.ATTR_TORCH_DTYPE] if schema.ATTR_TORCH_DTYPE in ds.attrs else None
        self.direct = (self.stored_as is not None and ds.ndim > 1 and ds.compression is None
                       and ds.chunks == (1, *self.row_shape))

    def _extend(self, row: int) -> None:
        if self.rows <= row:
            self.id.set_extent((row + 1, *self.row_shape))
            self.rows = row + 1
            self._fspace = self.id.get_space()

    def widen(self, columns: int) -> None:
        """Grow a 2-D table's column axis (param groups of lr, state keys of state_present) to `columns`."""
        if self.row_shape[0] < columns:
            self.id.set_extent((self.rows, columns))
            self._fspace = self.id.get_space()
            self.row_shape = (columns,)
            self._shape_rows()

    def _shape_rows(self) -> None:
        """The selection of one row, made once (a new selection and memory type per write doubled its cost)."""
        self._origin = (0,) * len(self.row_shape)
        self._memory = h5s.create_simple((1, *self.row_shape))

    def write(self, row: int, value) -> None:
        """Write row `row` (growing the dataset to hold it) from a value of the row's shape."""
        array = np.asarray(value, dtype=self.dtype)
        if array.shape != self.row_shape:
            raise TypeError(f"{self.ds.name}: a row of shape {array.shape} does not fit rows of shape "
                            f"{self.row_shape}")
        self._extend(row)
        if not array.size:  # a rank's empty shard: the row exists, it holds nothing
            return
        if self.direct and array.flags.c_contiguous:
            self.id.write_direct_chunk((row, *self._origin), array)
            return
        fspace = self._fspace
        fspace.select_hyperslab((row, *self._origin), (1, *self.row_shape))
        self.id.write(self._memory, fspace, array.reshape((1, *self.row_shape)), self._mtype)

    def write_rows(self, start: int, values) -> None:
        """Write rows start, start + 1, ... from an array of them (a batch's), with one write."""
        array = np.asarray(values, dtype=self.dtype)
        if array.shape[1:] != self.row_shape:
            raise TypeError(f"{self.ds.name}: rows of shape {array.shape[1:]} do not fit rows of shape "
                            f"{self.row_shape}")
        if not len(array):
            return
        self._extend(start + len(array) - 1)
        if not array.size:  # rows of no columns: they exist, they hold nothing
            return
        fspace = self._fspace
        fspace.select_hyperslab((start, *self._origin), array.shape)
        self.id.write(h5s.create_simple(array.shape), fspace, array, self._mtype)

    def write_block(self, start: int, values) -> None:
        """Write rows start, start + 1, ... (one row: through the selection kept for it)."""
        if len(values) == 1:
            self.write(start, values[0])
        else:
            self.write_rows(start, values)

    def _stored(self, tensor: torch.Tensor) -> np.ndarray:
        array = encoding.tensor_to_numpy(tensor, self.stored_as)
        if array.dtype != self.dtype:  # a tensor of another dtype under the same name: converted, as h5py would
            array = array.astype(self.dtype)
        return array

    def write_tensor(self, row: int, tensor: torch.Tensor) -> None:
        """Write a tensor as the dataset stores it (its ``torch_dtype`` attribute: bfloat16 as raw bits)."""
        self.write(row, self._stored(tensor))

    def write_tensors(self, rows: list) -> None:
        """Write (row, tensor) pairs of several records: the dataset grows once; scalar rows (0-d tensors, such as
        a step count) in consecutive rows are one write."""
        if len(rows) == 1:
            self.write_tensor(*rows[0])
            return
        self._extend(rows[-1][0])
        first = rows[0][0]
        if not self.row_shape and rows[-1][0] - first == len(rows) - 1:
            self.write_rows(first, np.array([self._stored(tensor) for _, tensor in rows]))
            return
        for row, tensor in rows:
            self.write_tensor(row, tensor)


OpenTensor = Callable[[h5py.Group, str, "torch.Tensor", int, "str | None"], h5py.Dataset]


class ParamRows:
    """One parameter's group: its datasets' handles, its row count and its state keys, kept between records."""

    def __init__(self, group: h5py.Group, open_tensor: OpenTensor, storage_dtype: str,
                 at_commit: Callable[[Callable[[], None]], None] | None = None):
        """at_commit: how the writer defers a change readers must not see before the record's commit (the state
        keys attribute, which names datasets that are linked at the commit); None: made at once."""
        self._at_commit = at_commit or (lambda change: change())
        self.group = group
        self.state_group = group[schema.STATE_GROUP]
        self.record_index = Rows(group[schema.RECORD_INDEX])
        self.state_present = Rows(group[schema.STATE_PRESENT])
        self.state_keys: list = encoding.from_json(self.state_group.attrs[schema.STATE_KEYS])
        self._open_tensor = open_tensor
        self._storage_dtype = storage_dtype
        self._tensors: dict[str, Rows] = {}  # kind -> its dataset
        self._state: dict[str, Rows] = {}  # state key -> its dataset

    @property
    def rows(self) -> int:
        """Rows of this parameter (the records that hold it)."""
        return self.record_index.rows

    def _dataset(self, kept: dict, group: h5py.Group, name: str, tensor: torch.Tensor, row: int,
                 storage: str | None) -> Rows:
        found = kept.get(name)
        if found is None:
            found = kept[name] = Rows(self._open_tensor(group, name, tensor, row, storage))
        return found

    def write(self, snap: ParamSnapshot, record: int, more: list = ()) -> list | None:
        """Append the parameter's row of record `record`, and one row per (snapshot, record) of `more` (the same
        parameter in the records that follow, written together: each dataset grows once, small rows are one write
        each); return its state keys when a snapshot has state."""
        items = [(snap, record), *more]
        row = self.rows
        for k, kind in enumerate(schema.TENSOR_KINDS):
            rows = [(row + i, tensor) for i, (s, _) in enumerate(items)
                    if (tensor := (s.param, s.grad, s.param_after)[k]) is not None]
            if rows:
                self._dataset(self._tensors, self.group, kind, rows[0][1], rows[0][0], None).write_tensors(rows)
        keys = None
        states = [s.state for s, _ in items]
        if any(states):
            keys = self._write_state(row, states)
        elif self.state_present.row_shape[0]:
            self.state_present.write_block(row, np.zeros((len(items), *self.state_present.row_shape), "u1"))
        self.record_index.write_block(row, np.array([r for _, r in items], np.int64))
        return keys

    def _write_state(self, row: int, states: list) -> list:
        """The state rows of consecutive rows from `row`, one state dict (maybe empty) per row."""
        keys = self.state_keys
        new = list(dict.fromkeys(key for state in states for key in state if key not in keys))
        if new:
            keys.extend(new)
            self.state_present.widen(len(keys))
            text, group = encoding.to_json(keys), self.state_group
            self._at_commit(lambda: group.attrs.__setitem__(schema.STATE_KEYS, text))
        present = np.zeros((len(states), len(keys)), "u1")
        for k, key in enumerate(keys):
            rows = [(row + i, tensor) for i, state in enumerate(states) if (tensor := state.get(key)) is not None]
            if rows:
                storage = encoding.state_storage_dtype(rows[0][1], self._storage_dtype)
                self._dataset(self._state, self.state_group, key, rows[0][1], rows[0][0], storage).write_tensors(rows)
                present[[r - row for r, _ in rows], k] = 1
        self.state_present.write_block(row, present)
        return keys


class RecordRows:
    """An optimizer's record table: the columns a full record appends to, and its commit column."""

    def __init__(self, records: h5py.Group):
        self.step = Rows(records[schema.COMMIT_COLUMN])
        self.backward_pass = Rows(records[schema.BACKWARD_PASS])
        self.wall_time = Rows(records[schema.WALL_TIME])
        self.hparams = Rows(records[schema.HPARAMS])
        self.lr = Rows(records[schema.LR])
        # Optional: a resumed run written before it existed goes on without it.
        self.closure_losses = Rows(records[schema.CLOSURE_LOSSES]) if schema.CLOSURE_LOSSES in records else None

    def write(self, first: int, recs: list[Record]) -> None:
        """The rows of records first, first + 1, ... (`recs`, in order) of every column but the commit column."""
        self.backward_pass.write_block(first, np.array([rec.backward_pass for rec in recs], np.int64))
        self.wall_time.write_block(first, np.array([rec.wall_time for rec in recs], np.float64))
        self.hparams.write_block(first, [encoding.to_json(rec.hparams) for rec in recs])
        if self.closure_losses is not None:
            self.closure_losses.write_block(first, [encoding.to_json(rec.closure_losses) for rec in recs])
        # One lr per param group; the group axis grows with add_param_group, NaN for groups absent from a record.
        self.lr.widen(max(len(rec.hparams) for rec in recs))
        lr_rows = np.full((len(recs), *self.lr.row_shape), np.nan)
        for i, rec in enumerate(recs):
            lr_rows[i, : len(rec.hparams)] = [encoding.lr_of(g) for g in rec.hparams]
        self.lr.write_block(first, lr_rows)

    def commit(self, first: int, steps: list) -> None:
        """Append the steps of records first, first + 1, ...: readers see them from the flush that follows."""
        self.step.write_block(first, np.array(steps, np.int64))


class ScalarRows:
    """An optimizer's logged-scalars table: its columns' handles and the name -> column map, kept. Rows are appended
    after the committed ones; the caller commits them (``commit``) after a flush, like a record."""

    def __init__(self, table: h5py.Group):
        self.table = table
        self.step = Rows(table[schema.COMMIT_COLUMN])
        self.wall_time = Rows(table[schema.WALL_TIME])
        self.values = Rows(table[schema.VALUES])
        self.columns = {name: i for i, name in enumerate(encoding.from_json(table.attrs[schema.SCALAR_COLUMNS]))}

    def write(self, rows: list) -> None:
        """rows: (step, wall_time, {name: value}) per step that logged something; a new name gains a column."""
        added = False
        for _, _, values in rows:
            for name in values:
                if name not in self.columns:
                    self.columns[name] = len(self.columns)
                    added = True
        if added:
            self.table.attrs[schema.SCALAR_COLUMNS] = encoding.to_json(list(self.columns))
        self.values.widen(len(self.columns))
        block = np.full((len(rows), *self.values.row_shape), np.nan)
        for i, (_, _, values) in enumerate(rows):
            for name, value in values.items():
                block[i, self.columns[name]] = value
        start = self.step.rows
        self.values.write_rows(start, block)
        self.wall_time.write_rows(start, [wall_time for _, wall_time, _ in rows])

    def commit(self, rows: list) -> None:
        """Append the rows' steps: readers see them from the flush that follows."""
        self.step.write_rows(self.step.rows, [step for step, _, _ in rows])
