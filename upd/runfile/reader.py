"""Reading a run file: lazy, committed-records-only access to what the recorder wrote."""
from __future__ import annotations

import atexit
import json
import os
import stat
import warnings
import weakref
from functools import cached_property
from typing import Iterator

import h5py
import numpy as np
import pandas as pd
import torch

from . import encoding, schema
from . import livelock
from ..analyzer.ratio_table import ratios_frame, ratios_from_stats
from .stats_table import STATS_BLOCK_ROWS, committed_stats_rows, stats_frame, stats_param_meta


class RunFileError(Exception):
    """The file cannot be used as a torch-upd run. The message is one line naming the file and the problem."""

    def __init__(self, message="", *args):
        # One line, whatever an underlying library put into the text.
        super().__init__(" ".join(str(message).splitlines()), *args)


# Rows read at once when streaming a parameter's history: bounds memory on large runs.
DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024

# What the reader accepts from an untrusted file (docs/reliability.md, "Hostile and broken files").
MAX_RANK = 32  # HDF5's own limit on dataset rank
MAX_NUMEL = 2 ** 48  # elements of one parameter, as declared in its metadata
# Uncompressed, one block the reader reads at once (a record-table column, one row of a tensor) is stored in the
# file, so it cannot be larger than the file; HDF5's compression filters shrink data at most ~1032:1 (deflate).
# A declared shape beyond that is refused before anything is read or allocated.
MAX_COMPRESSION_RATIO = 4096
# Tables that grow columns (param groups, statistics slots) leave the chunks of earlier rows of a late column
# unallocated: a block may declare this many times the data stored for it (chunks hold 64 or more rows).
_SPARSE = 64
_NUMERIC_KINDS = "fiucb"  # numpy dtype kinds a tensor dataset may have: float, int, uint, complex, bool


def _problem(exc: BaseException) -> str:
    """An exception as a short one-line phrase for a RunFileError message."""
    text = " ".join(str(exc).split())
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Reading:
    """Context manager at the I/O edge: any error from h5py, numpy or JSON decoding while reading a part of the
    file becomes a RunFileError naming the file and that part. Wraps reads only, never the caller's own errors."""

    __slots__ = ("path", "what", "raw")

    def __init__(self, path: str, what: str, raw: "_GuardedFile | None" = None):
        self.path, self.what, self.raw = path, what, raw

    def __enter__(self) -> None:
        if self.raw is not None and self.raw.changed_under_us():
            raise RunFileError(f"{self.path}: the file changed after it was opened (a recorder resumed it, or "
                               "something rewrote it); open it again to read it")
        return None

    def __exit__(self, etype, exc, tb) -> bool:
        if exc is None or isinstance(exc, RunFileError) or not isinstance(exc, Exception):
            return False
        raise RunFileError(f"{self.path}: cannot read {self.what} ({_problem(exc)})") from exc


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise RunFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise RunFileError(f"{path}: is a directory, not a run file")
    if not os.access(path, os.R_OK):
        raise RunFileError(f"{path}: permission denied")
    try:
        st = os.stat(path)
    except OSError as exc:
        raise RunFileError(f"{path}: cannot stat the file ({_problem(exc)})") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
        raise RunFileError(f"{path}: not a regular file")
    if st.st_size == 0:
        raise RunFileError(f"{path}: empty file, not a run file")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_list_of_str(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _shape_problem(shape) -> str | None:
    """Why a shape from JSON metadata is not a sane tensor shape, or None when it is (None = no shape)."""
    if shape is None:
        return None
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        return f"shape {str(shape)[:80]} is not a list of integers"
    if len(shape) > MAX_RANK:
        return f"shape has {len(shape)} dimensions (at most {MAX_RANK})"
    if any(d < 0 for d in shape):
        return f"shape {shape} has a negative size"
    numel = 1
    for d in shape:
        numel *= int(d)
    if numel > MAX_NUMEL:
        return f"shape {str(shape)[:80]} declares {numel} elements (at most {MAX_NUMEL})"
    return None


_TORCH_TO_NUMPY: dict[str, np.dtype | None] = {}


def _numpy_dtype_of(torch_dtype_name: str) -> np.dtype | None:
    """The numpy dtype a tensor of this torch dtype is stored as (uint16 for bfloat16), None for no such dtype."""
    if torch_dtype_name not in _TORCH_TO_NUMPY:
        target = getattr(torch, torch_dtype_name, None) if torch_dtype_name.isidentifier() else None
        if target == torch.bfloat16:
            found = np.dtype(np.uint16)
        elif isinstance(target, torch.dtype):
            try:
                found = torch.empty((), dtype=target).numpy().dtype
            except (TypeError, RuntimeError):
                found = None
        else:
            found = None
        _TORCH_TO_NUMPY[torch_dtype_name] = found
    return _TORCH_TO_NUMPY[torch_dtype_name]


class _Validator:
    """Structure checks of one open file: every object is where the format puts it, with the expected kind of
    dtype and rank, and sizes this file can actually hold. Raises RunFileError naming the file and the object."""

    def __init__(self, path: str, file_size: int, raw: "_GuardedFile | None" = None):
        self.path = path
        self.file_size = file_size
        self.raw = raw  # the file as HDF5 reads it: raw access to what HDF5 would allocate for
        self._filtered: dict = {}  # dataset id -> has HDF5 filters (compression)

    def fail(self, where: str, problem: str) -> RunFileError:
        return RunFileError(f"{self.path}: {where}: {problem}")

    def reading(self, where: str) -> _Reading:
        return _Reading(self.path, where)

    def child(self, group: h5py.Group, name: str, where: str, kind=h5py.Dataset, required: bool = True):
        """group[name] as a hard-linked object of the given kind (None when absent and not required)."""
        with self.reading(where):
            link = _link_type(group, name)
            if link is None:
                if required:
                    raise self.fail(where, "missing")
                return None
            if link != h5py.h5l.TYPE_HARD:  # never followed: an external link opens another file, soft links loop
                raise self.fail(where, f"is a {_LINK_NAMES.get(link, 'link')}; a run file holds its data itself")
            obj = group[name]
        if not isinstance(obj, kind):
            found = "group" if isinstance(obj, h5py.Group) else "dataset" if isinstance(obj, h5py.Dataset) \
                else type(obj).__name__
            raise self.fail(where, f"is a {found}, expected a {'group' if kind is h5py.Group else 'dataset'}")
        return obj

    def members(self, group: h5py.Group, where: str) -> list[str]:
        with self.reading(where):
            names = list(group)
        for name in names:
            if not _is_utf8(name):
                raise self.fail(where, f"member name {name.encode('utf-8', 'replace')[:60]!r} is not valid UTF-8")
        return names

    def attr(self, obj, name: str, where: str):
        """obj.attrs[name] (KeyError when absent), after checking the lengths its stored strings claim: HDF5
        allocates what they claim before reading them."""
        found = None
        with self.reading(f"{where} attribute {name!r}"):
            stored = None if self.raw is None else self.raw.attributes(h5py.h5o.get_info(obj.id).addr)
            if stored is None:  # not parsed: ask HDF5 for the attribute's header
                try:
                    shape = obj.attrs.get_id(name).shape
                    found = (1 if shape is None else _product(shape)), []
                except KeyError:
                    pass
            else:
                found = stored.get(name)
        if found is None:
            raise KeyError(name)  # absent (raised outside reading(), which would make it a RunFileError)
        count, lengths = found
        if count > 1:
            raise self.fail(where, f"attribute {name!r} holds {count} values, expected a single one")
        if lengths and max(lengths) > schema.MAX_META_BYTES:
            raise self.fail(where, f"attribute {name!r} claims a string of {max(lengths)} bytes (the limit is "
                                   f"{schema.MAX_META_BYTES})")
        with self.reading(f"{where} attribute {name!r}"):
            return obj.attrs[name]

    def vlen_rows(self, ds: h5py.Dataset, rows: range, where: str) -> None:
        """Before HDF5 reads strings `rows` of ds: refuse lengths it would allocate that no valid run has."""
        if self.raw is None or not len(rows):
            return
        with self.reading(where):
            lengths = self.raw.dataset_vlen_lengths(ds, rows)
        claimed = max(lengths or [0])
        if claimed > schema.MAX_META_BYTES:
            raise self.fail(where, f"claims a string of {claimed} bytes (the limit is {schema.MAX_META_BYTES})")

    def get_attr(self, obj, name: str, where: str, default=None):
        try:
            return self.attr(obj, name, where)
        except KeyError:
            return default

    def json_attr(self, obj, name: str, where: str, expected: type | None = None, default=None, required=True):
        """A JSON text attribute, decoded with the size limit of upd.format; expected: the JSON type it must be."""
        try:
            raw = self.attr(obj, name, where)
        except KeyError:
            if required:
                raise self.fail(where, f"attribute {name!r} missing") from None
            return default
        try:
            value = _json_value(raw)
        except (ValueError, RecursionError, MemoryError) as exc:  # RecursionError: "[[[[..." nested too deep
            raise self.fail(where, f"attribute {name!r} is not valid JSON text ({_problem(exc)})") from None
        if expected is not None and not isinstance(value, expected):
            raise self.fail(where, f"attribute {name!r} is JSON {type(value).__name__}, expected "
                                   f"{expected.__name__ if isinstance(expected, type) else 'another type'}")
        return value

    def filtered(self, ds: h5py.Dataset) -> bool:
        """Whether ds passes through HDF5 filters (compression): its chunks' stored sizes come from the file."""
        if ds.id not in self._filtered:
            with self.reading(ds.name):
                self._filtered[ds.id] = ds.id.get_create_plist().get_nfilters() > 0
        return self._filtered[ds.id]

    def limit(self, ds: h5py.Dataset) -> int:
        return self.file_size * (MAX_COMPRESSION_RATIO if self.filtered(ds) else 1)

    def dataset(self, group, name: str, where: str, kinds: str, rank: int | None = None, min_rank: int = 1,
                required: bool = True) -> h5py.Dataset | None:
        """group[name] as a dataset whose dtype kind is in kinds and whose rank is rank (or at least min_rank)."""
        ds = self.child(group, name, where, h5py.Dataset, required)
        if ds is None:
            return None
        with self.reading(where):
            dtype, shape = ds.dtype, ds.shape
            dcpl = ds.id.get_create_plist()
            layout, external = dcpl.get_layout(), dcpl.get_external_count()
            self._filtered[ds.id] = dcpl.get_nfilters() > 0
        if external or layout == h5py.h5d.VIRTUAL:
            raise self.fail(where, "stores its data in other files; a run file holds its data itself")
        if shape is None:
            raise self.fail(where, "has no dataspace (an empty dataset)")
        if kinds == "string":
            if h5py.check_string_dtype(dtype) is None:
                raise self.fail(where, f"has dtype {dtype}, expected UTF-8 strings")
        elif dtype.kind not in kinds or dtype.fields is not None or dtype.subdtype is not None \
                or not dtype.isnative:
            raise self.fail(where, f"has dtype {dtype}, expected {_KIND_NAMES.get(kinds, kinds)}")
        if rank is not None and len(shape) != rank:
            raise self.fail(where, f"has shape {shape}, expected {rank} dimension(s)")
        if len(shape) < min_rank:
            raise self.fail(where, f"has shape {shape}, expected at least {min_rank} dimension(s)")
        return ds

    def readable(self, ds: h5py.Dataset, rows: int, where: str, sparse: int = 1) -> None:
        """Refuse reading `rows` rows of ds in one block when this file cannot hold that much data. sparse: how many
        times the stored data a valid file's block may declare (columns added late leave chunks unallocated)."""
        if rows <= 0:
            return
        per_row = ds.dtype.itemsize
        for d in ds.shape[1:]:
            per_row *= int(d)
        need = rows * per_row
        if need > self.file_size * sparse and need > self.limit(ds) * sparse:
            raise self.fail(where, f"declares shape {ds.shape}: {_size(need)} to read at once, more than a "
                                   f"{_size(self.file_size)} file can hold")

    def tensor_dtype(self, ds: h5py.Dataset, where: str) -> str | None:
        """The torch_dtype attribute of a tensor dataset, checked against the numpy dtype it is stored as."""
        raw = self.get_attr(ds, "torch_dtype", where)
        if raw is None:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        if not isinstance(raw, str):
            raise self.fail(where, f"attribute 'torch_dtype' is {type(raw).__name__}, expected a dtype name")
        expected = _numpy_dtype_of(raw)
        if expected is None:
            raise self.fail(where, f"attribute 'torch_dtype' {raw[:40]!r} is not a torch dtype this reader knows")
        if ds.dtype != expected:
            raise self.fail(where, f"holds {ds.dtype} data but its torch_dtype says {raw}")
        return raw


_LINK_NAMES = {h5py.h5l.TYPE_SOFT: "soft link", h5py.h5l.TYPE_EXTERNAL: "link to another file"}


def _link_type(group: h5py.Group, name: str) -> int | None:
    """The type of the link group/name (h5py.h5l.TYPE_*), None when there is none; follows no link but hard links
    (a path like 'state/exp_avg' is resolved one hard-linked component at a time)."""
    parts = name.split("/")
    for i in range(1, len(parts) + 1):
        path = "/".join(parts[:i]).encode("utf-8")
        if not group.id.links.exists(path):
            return None
        kind = group.id.links.get_info(path).type
        if kind != h5py.h5l.TYPE_HARD or i == len(parts):
            return kind
    return None


def _product(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # h5py decodes invalid UTF-8 with surrogate escapes; "\\udcff" in JSON does too
        return False
    return True


def _json_value(raw):
    """encoding.from_json, refusing text that is not valid UTF-8 (it could not be printed or written back)."""
    if isinstance(raw, str) and not _is_utf8(raw):
        raise ValueError("text is not valid UTF-8")
    value = encoding.from_json(raw)
    if not isinstance(value, (int, float, bool, type(None))) and not _is_utf8(json.dumps(value, ensure_ascii=False)):
        raise ValueError("text holds an invalid Unicode escape (a lone surrogate)")
    return value


_KIND_NAMES = {"iu": "integers", "fiu": "numbers", "f": "floats", _NUMERIC_KINDS: "numbers", "iub": "integers"}


def _size(nbytes: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} bytes"


DUMP_COLUMNS = ["optimizer", "reason", "trigger_step", "steps", "wall_time"]


def _deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


class _TableMethod:
    """What ``run.params``, ``run.steps`` and ``run.dumps`` return: call it for the table (the API's convention is
    that every DataFrame comes from a method, like ``ratios()`` and ``stats()``).

    These three were attributes before that convention: code that still uses one as the table (indexing,
    ``len``, iteration, any DataFrame attribute) keeps working for one release, with a DeprecationWarning."""

    __slots__ = ("_make", "_name", "_legacy")

    def __init__(self, make, name: str, legacy=None):
        self._make, self._name, self._legacy = make, name, legacy or make

    def __call__(self) -> pd.DataFrame:
        return self._make()

    def _old_value(self):
        _deprecated(f"Run.{self._name} used as an attribute", f"Run.{self._name}() (a method call)", stacklevel=4)
        return self._legacy()

    def __getattr__(self, name):
        return getattr(self._old_value(), name)

    def __getitem__(self, key):
        return self._old_value()[key]

    def __len__(self) -> int:
        return len(self._old_value())

    def __iter__(self):
        return iter(self._old_value())

    def __eq__(self, other):
        return self._old_value() == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"<bound table Run.{self._name}(): call it for the DataFrame>"


class ParamRecord:
    """One parameter's recorded history inside one optimizer."""

    def __init__(self, optimizer: "OptimizerRun", name: str, group: h5py.Group, check: "_Validator | None" = None):
        self.optimizer = optimizer
        self.name = name
        self._group = group
        check = check or optimizer.run._validator()
        where = f"parameter {name!r} of optimizer {optimizer.index}"
        self.meta = check.json_attr(group, schema.ATTR_META, where, dict)
        problem = _shape_problem(self.meta.get("shape"))
        if problem is None and not (self.meta.get("dtype") is None or isinstance(self.meta.get("dtype"), str)):
            problem = "dtype is not a string"
        for key in ("group", "index_in_group"):
            value = self.meta.get(key)
            if problem is None and value is not None and not (_is_int(value) and value >= 0):
                problem = f"{key} {str(value)[:40]} is not a non-negative integer"
        if problem:
            raise check.fail(where, f"metadata {problem}")
        index_ds = check.dataset(group, schema.RECORD_INDEX, f"{where}: dataset 'record'", "iu", rank=1)
        check.readable(index_ds, index_ds.shape[0], f"{where}: dataset 'record'")
        with check.reading(f"{where}: dataset 'record'"):
            records = index_ds[()].astype(np.int64, copy=False)
        if len(records) and (records.min() < 0 or (np.diff(records) < 0).any()):
            raise check.fail(f"{where}: dataset 'record'", "record indices are negative or not in increasing order")
        # Rows whose record was never committed (a crash mid-record) do not exist for readers.
        self.records = records[records < optimizer.num_records]
        self.shape = tuple(int(d) for d in self.meta.get("shape") or ())
        self.dtype = self.meta.get("dtype")
        self.param_group = self.meta.get("group")
        if self.param_group is not None:
            self.param_group = int(self.param_group)
        self._storage: dict[str, str | None] = {}
        for kind in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER):
            ds = check.dataset(group, kind, f"{where}: dataset {kind!r}", _NUMERIC_KINDS, required=False)
            if ds is None:
                continue
            if ds.shape[1:] != self.shape:
                raise check.fail(f"{where}: dataset {kind!r}", f"has shape {ds.shape}: rows of {list(ds.shape[1:])}, "
                                                              f"but the parameter's shape is {list(self.shape)}")
            if ds.shape[0] < self.num_rows:
                raise check.fail(f"{where}: dataset {kind!r}", f"has {ds.shape[0]} rows, fewer than the parameter's "
                                                              f"{self.num_rows} committed records")
            check.readable(ds, 1 if self.num_rows else 0, f"{where}: dataset {kind!r}")
            self._storage[kind] = check.tensor_dtype(ds, f"{where}: dataset {kind!r}")
        self._state_keys: list[str] = []
        self._state_dtypes: dict[str, str | None] = {}
        state = check.child(group, schema.STATE_GROUP, f"{where}: group 'state'", h5py.Group, required=False)
        if state is not None:
            keys = check.json_attr(state, "keys", f"{where}: group 'state'", list, default=[], required=False)
            if not _is_list_of_str(keys):
                raise check.fail(f"{where}: group 'state'", "attribute 'keys' is not a JSON list of strings")
            self._state_keys = list(keys)
            for key in keys:
                ds = check.dataset(state, key, f"{where}: state {key!r}", _NUMERIC_KINDS, required=False)
                if ds is not None:  # absent: only an error if a committed row says it is present (state_at)
                    check.readable(ds, 1, f"{where}: state {key!r}")
                    self._state_dtypes[key] = check.tensor_dtype(ds, f"{where}: state {key!r}")
            if keys:
                present = check.dataset(group, schema.STATE_PRESENT, f"{where}: dataset 'state_present'", "iub", rank=2)
                check.readable(present, 1, f"{where}: dataset 'state_present'")

    @property
    def num_rows(self) -> int:
        """Rows stored (one per committed record that holds this parameter); index them with ``read``."""
        return len(self.records)

    @property
    def rows(self) -> int:
        _deprecated("ParamRecord.rows", "ParamRecord.num_rows")
        return self.num_rows

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def kinds(self) -> list[str]:
        return [k for k in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER) if k in self._storage]

    @cached_property
    def state_keys(self) -> list[str]:
        return list(self._state_keys)

    def _reading(self, what: str) -> _Reading:
        return _Reading(self.optimizer.run.path,
                        f"{what} of parameter {self.name!r} (optimizer {self.optimizer.index})",
                        getattr(self.optimizer.run, "_raw", None))

    def _decode(self, ds: h5py.Dataset, rows, torch_dtype: str | None) -> torch.Tensor:
        return encoding.numpy_to_tensor(ds[rows], torch_dtype or "float32")

    def _has(self, kind: str) -> bool:
        if kind in self._storage:
            return True
        with self._reading(repr(kind)):
            return _link_type(self._group, kind) is not None  # the link itself: never follows it

    def _checked(self, kind: str) -> str | None:
        """The storage dtype of a dataset outside the three kinds (e.g. 'state/exp_avg'), checked like them."""
        check = self.optimizer.run._validator()
        where = f"parameter {self.name!r} of optimizer {self.optimizer.index}: dataset {kind!r}"
        ds = check.dataset(self._group, kind, where, _NUMERIC_KINDS)
        check.readable(ds, 1, where)
        return check.tensor_dtype(ds, where)

    def read(self, kind: str, rows=slice(None)) -> torch.Tensor:
        """Tensor of kind ('param', 'grad', 'param_after') at the given row(s); rows index ``self.records``."""
        if not self._has(kind):
            raise KeyError(f"{self.name}: no {kind!r} recorded")
        rows = self._clip(rows)
        torch_dtype = self._storage[kind] if kind in self._storage else self._checked(kind)
        with self._reading(f"{kind!r} rows {_rows_text(rows)}"):
            return self._decode(self._group[kind], rows, torch_dtype)

    def _clip(self, rows):
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.num_rows)
            return slice(start, stop, step)
        if isinstance(rows, (int, np.integer)):
            if not -self.num_rows <= rows < self.num_rows:
                raise IndexError(f"{self.name}: row {rows} out of range ({self.num_rows} rows)")
            return int(rows) % self.num_rows
        index = np.asarray(rows)
        if index.dtype.kind == "b":
            if index.shape != (self.num_rows,):
                raise IndexError(f"{self.name}: boolean row mask of shape {index.shape}, expected ({self.num_rows},)")
            index = np.nonzero(index)[0]
        if index.ndim != 1 or (len(index) and index.dtype.kind not in "iu"):
            raise IndexError(f"{self.name}: rows must be an int, a slice or a 1-D sequence of ints")
        if len(index) and (index.min() < 0 or index.max() >= self.num_rows):
            raise IndexError(f"{self.name}: rows out of range ({self.num_rows} rows)")
        if (np.diff(index) <= 0).any():
            raise IndexError(f"{self.name}: a sequence of rows must be increasing")
        return index.astype(np.intp)

    def state_at(self, row: int) -> dict[str, torch.Tensor]:
        """Optimizer state (before the step) at one row: only the keys that were present."""
        keys = self.state_keys
        if not keys:
            return {}
        out = {}
        with self._reading(f"state at row {row}"):
            present_ds = self._group[schema.STATE_PRESENT]
            present = present_ds[row] if row < present_ds.shape[0] else np.zeros(present_ds.shape[1], "u1")
            state = self._group[schema.STATE_GROUP]
            for i, key in enumerate(keys):
                if i < len(present) and present[i]:
                    if key not in state:
                        raise RunFileError(f"{self.optimizer.run.path}: state {key!r} of parameter {self.name!r} "
                                           f"(optimizer {self.optimizer.index}) is marked present at row {row} "
                                           f"but has no dataset")
                    ds = state[key]
                    if not -ds.shape[0] <= row < ds.shape[0]:
                        raise RunFileError(f"{self.optimizer.run.path}: state {key!r} of parameter {self.name!r} "
                                           f"(optimizer {self.optimizer.index}) is marked present at row {row} but "
                                           f"has only {ds.shape[0]} rows")
                    out[key] = self._decode(ds, row, self._state_dtypes.get(key))
        return out

    def storage_dtype(self, kind: str = schema.KIND_PARAM) -> str | None:
        if kind in self._storage:
            return self._storage[kind]
        return self._checked(kind) if self._has(kind) else None

    def block_rows(self, block_bytes: int = DEFAULT_BLOCK_BYTES, kinds: int = 3) -> int:
        per_row = max(1, self.numel * 8 * kinds)  # float64 working copies dominate
        return max(1, block_bytes // per_row)

    def iter_blocks(self, kinds, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[tuple[slice, dict]]:
        """Yield (row slice, {kind: tensor}) over the whole history, a bounded number of rows at a time."""
        step = self.block_rows(block_bytes, max(1, len(kinds)))
        for start in range(0, self.num_rows, step):
            rows = slice(start, min(start + step, self.num_rows))
            yield rows, {k: self.read(k, rows) for k in kinds if self._has(k)}

    def __repr__(self) -> str:
        return f"<ParamRecord {self.name} {list(self.shape)} {self.num_rows} rows>"


def _rows_text(rows) -> str:
    if isinstance(rows, slice):
        return f"{rows.start}:{rows.stop}" + (f":{rows.step}" if rows.step != 1 else "")
    if isinstance(rows, int):
        return str(rows)
    return f"({len(rows)} rows)"


class OptimizerRun:
    """One recorded optimizer: its committed records and its parameters."""

    def __init__(self, run: "Run", index: int, group: h5py.Group, check: "_Validator | None" = None):
        self.run = run
        self.index = index
        self._group = group
        check = check or run._validator()
        where = f"optimizer {index}"
        self.meta = check.json_attr(group, schema.ATTR_META, where, dict)
        if not isinstance(self.meta.get("class", "?"), str) or not _is_list_of_str(self.meta.get("mro", [])):
            raise check.fail(where, "metadata 'class' is not a string or 'mro' not a list of strings")
        records = check.child(group, "records", f"{where}: group 'records'", h5py.Group)
        rec = f"{where}: dataset 'records/%s'"
        step_ds = check.dataset(records, "step", rec % "step", "iu", rank=1)
        self.num_records = int(step_ds.shape[0])
        columns = {"backward_pass": ("iu", 1), "wall_time": ("fiu", 1), "lr": ("f", 2), "hparams": ("string", 1)}
        found = {}
        for name, (kinds, rank) in columns.items():
            ds = found[name] = check.dataset(records, name, rec % name, kinds, rank=rank)
            if ds.shape[0] < self.num_records:
                raise check.fail(rec % name, f"has {ds.shape[0]} rows, fewer than the {self.num_records} committed "
                                             f"steps (records/step)")
        for name, ds in (("step", step_ds), ("backward_pass", found["backward_pass"]),
                         ("wall_time", found["wall_time"])):
            check.readable(ds, self.num_records, rec % name)
        check.readable(found["lr"], self.num_records, rec % "lr", sparse=_SPARSE)
        closure = check.dataset(records, "closure_losses", rec % "closure_losses", "string", rank=1, required=False)
        with check.reading(f"{where}: the record table"):
            self.steps = step_ds[()].astype(np.int64, copy=False)
            self.backward_passes = found["backward_pass"][: self.num_records]
            self.wall_times = found["wall_time"][: self.num_records]
            self.learning_rates = found["lr"][: self.num_records]
        self._hparams_ds = found["hparams"]
        self._closure_ds = closure
        self.class_name = self.meta.get("class", "?")
        params = check.child(group, "params", f"{where}: group 'params'", h5py.Group)
        records = [ParamRecord(self, name, check.child(params, name, f"{where}: parameter {name!r}", h5py.Group),
                           check)
                   for name in check.members(params, f"{where}: group 'params'")]
        groups = self.learning_rates.shape[1]
        for p in records:
            if p.num_rows and (p.param_group or 0) >= groups:
                raise check.fail(f"{where}: parameter {p.name!r}", f"param group {p.param_group or 0} does not exist "
                                                                   f"(records/lr has {groups} group column(s))")
        # HDF5 lists names alphabetically (layers.10 before layers.3); show them in the optimizer's order.
        records.sort(key=lambda p: (p.param_group or 0, p.meta.get("index_in_group") or 0))
        self.param_records: dict[str, ParamRecord] = {p.name: p for p in records}
        with check.reading(f"{where}: group 'stats'"):
            has_stats = _link_type(group, "stats") is not None  # the link itself: never follows it
        if has_stats:  # the per-step statistics table (stats_table reads it)
            _check_stats(check, group, where)

    def _reading(self, what: str) -> _Reading:
        return _Reading(self.run.path, f"{what} of optimizer {self.index}", getattr(self.run, "_raw", None))

    def hparams(self, record: int) -> list[dict]:
        """The param groups' hyperparameters at one record, as the optimizer saw them (JSON-decoded)."""
        if not 0 <= record < self.num_records:
            raise IndexError(f"record {record} out of range ({self.num_records} records)")
        self.run._validator().vlen_rows(self._hparams_ds, range(record, record + 1),
                                        f"optimizer {self.index}: records/hparams[{record}]")
        with self._reading(f"records/hparams[{record}]"):
            value = _json_value(self._hparams_ds[record])
        if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
            raise RunFileError(f"{self.run.path}: optimizer {self.index}: records/hparams[{record}] is not a JSON list "
                               f"of param-group objects")
        return value

    def closure_losses(self, record: int) -> list | None:
        """Losses of each closure evaluation inside the step (LBFGS & co.), or None for a step without closure."""
        ds = self._closure_ds
        if ds is None or not 0 <= record < ds.shape[0]:
            return None
        self.run._validator().vlen_rows(ds, range(record, record + 1),
                                        f"optimizer {self.index}: records/closure_losses[{record}]")
        with self._reading(f"records/closure_losses[{record}]"):
            value = _json_value(ds[record])
        if value is not None and not isinstance(value, list):
            raise RunFileError(f"{self.run.path}: optimizer {self.index}: records/closure_losses[{record}] is not a "
                               f"JSON list or null")
        return value

    # Names before the naming convention (see Run): kept one release, with a DeprecationWarning.
    @property
    def params(self) -> dict:
        _deprecated("OptimizerRun.params", "OptimizerRun.param_records")
        return self.param_records

    @property
    def step(self) -> np.ndarray:
        _deprecated("OptimizerRun.step", "OptimizerRun.steps")
        return self.steps

    @property
    def backward_pass(self) -> np.ndarray:
        _deprecated("OptimizerRun.backward_pass", "OptimizerRun.backward_passes")
        return self.backward_passes

    @property
    def wall_time(self) -> np.ndarray:
        _deprecated("OptimizerRun.wall_time", "OptimizerRun.wall_times")
        return self.wall_times

    @property
    def lr(self) -> np.ndarray:
        _deprecated("OptimizerRun.lr", "OptimizerRun.learning_rates")
        return self.learning_rates

    def __repr__(self) -> str:
        return (f"<OptimizerRun {self.index} {self.class_name}: {len(self.param_records)} params, "
                f"{self.num_records} records>")


def _check_stats(check: "_Validator", group: h5py.Group, where: str) -> None:
    """The statistics table, as far as stats_table reads it: attributes, dtypes, ranks and block sizes."""
    st = check.child(group, "stats", f"{where}: group 'stats'", h5py.Group)
    with check.reading(f"{where}: group 'stats'"):
        if _link_type(st, "values") is None:
            return  # no statistics row written yet: the reader ignores the table
    at = f"{where}: statistics table"
    step = check.dataset(st, "step", f"{at} 'step'", "iu", rank=1)
    n = int(step.shape[0])
    check.readable(step, n, f"{at} 'step'")
    lr = check.dataset(st, "lr", f"{at} 'lr'", "f", rank=2)
    check.readable(lr, min(n, lr.shape[0]), f"{at} 'lr'", sparse=_SPARSE)
    values = check.dataset(st, "values", f"{at} 'values'", "f", rank=3)
    if values.shape[0] < n:
        raise check.fail(f"{at} 'values'", f"has {values.shape[0]} rows, fewer than the {n} committed steps")
    check.readable(values, min(n, STATS_BLOCK_ROWS), f"{at} 'values'", sparse=_SPARSE)
    params = check.json_attr(st, "params", at, list)
    columns = check.json_attr(st, "columns", at, list)
    meta = check.json_attr(st, "param_meta", at, dict, default={}, required=False)
    if not (_is_list_of_str(params) and _is_list_of_str(columns)) or len(set(params)) < len(params) \
            or len(set(columns)) < len(columns):
        raise check.fail(at, "attributes 'params' and 'columns' must be JSON lists of distinct names")
    if len(columns) < values.shape[2]:
        raise check.fail(at, f"'values' has {values.shape[2]} columns but attribute 'columns' names {len(columns)}")
    for name, m in meta.items():
        problem = "is not an object" if not isinstance(m, dict) else _shape_problem(m.get("shape"))
        if problem is None and not (m.get("group") is None or (_is_int(m["group"]) and m["group"] >= 0)):
            problem = "group is not a non-negative integer"
        if problem is None and not (m.get("dtype") is None or isinstance(m["dtype"], str)):
            problem = "dtype is not a string"
        if problem:
            raise check.fail(at, f"param_meta of {str(name)[:80]!r}: {problem}")


def _check_run_meta(check: "_Validator", meta: dict) -> None:
    """The root metadata fields readers use: types that `upd info` and `upd verify` can work with."""
    problem = None
    version = meta.get("torch_version")
    if not (version is None or (isinstance(version, str) and len(version) <= 100)):
        problem = "'torch_version' is not a version string"
    created = meta.get("created_unix")
    if created is not None and not (isinstance(created, (int, float)) and not isinstance(created, bool)
                                    and -62135596800 < created < 253402300800):  # datetime's years 1..9999
        problem = f"'created_unix' {str(created)[:40]} is not a Unix time"
    options = meta.get("options", {})
    if not isinstance(options, dict):
        problem = "'options' is not an object"
    elif not _is_list_of_str(options.get("what", [])):
        problem = "'options.what' is not a list of strings"
    if problem:
        raise check.fail("run metadata", problem)


class _GuardedFile:
    """The run file as HDF5 reads it (h5py's ``fileobj`` driver), with the checks HDF5 (2.0.0) lacks.

    HDF5 loops forever, holding the GIL, when a global heap collection (where variable-length strings such as every
    JSON attribute live) contains a zero-size object: 16 zeroed bytes in the file hang any reader. Every read HDF5
    makes passes here; a collection is walked in Python the way HDF5 will walk it, once, and refused (an OSError
    HDF5 reports as a read error) when the walk would not advance. The methods below read the stored references
    of variable-length strings, whose claimed lengths HDF5 allocates before reading them.
    """

    MAX_COLLECTION = schema.MAX_META_BYTES + (1 << 20)  # the largest string a run holds, in a collection of its own

    _GCOL = b"GCOL"

    def __init__(self, path: str, fd: int | None = None, snapshot: bool = False):
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0)) if fd is None else fd
        self._pos = 0
        opened = os.fstat(self._fd)
        self._size = opened.st_size
        # Read in place (not a private copy): HDF5 reads it lazily, so a writer that starts later (resume=True)
        # could change metadata under the reader's cache. Reads after that are refused, not trusted.
        self._identity = None if snapshot else (opened.st_size, opened.st_mtime_ns)
        self._changed = False
        self._checked: set[int] = set()
        self._attr_cache: dict[int, dict | None] = {}
        self._offset_size, self._length_size = self._superblock_sizes()

    def _superblock_sizes(self) -> tuple[int, int]:
        """HDF5's 'size of offsets' and 'size of lengths' from the superblock (at 0, 512, 1024, ...); 8 and 8 when
        it cannot be found (HDF5 then refuses the file anyway)."""
        at = 0
        while at + 16 <= min(self._size, 1 << 20):
            head = os.pread(self._fd, 16, at)
            if head[:8] == schema.HDF5_SIGNATURE:
                offsets, lengths = (head[13], head[14]) if head[8] in (0, 1) else (head[9], head[10])
                return (offsets if offsets in (2, 4, 8) else 8), (lengths if lengths in (2, 4, 8) else 8)
            at = 512 if at == 0 else at * 2
        return 8, 8

    def changed_under_us(self) -> bool:
        """True once the file read in place has been changed, or is open for writing (sticky)."""
        if self._identity is None or self._changed or self._fd < 0:
            return self._changed
        now = os.fstat(self._fd)
        self._changed = (now.st_size, now.st_mtime_ns) != self._identity or livelock.writer_present(self._fd)
        return self._changed

    # -- the file-like interface h5py's fileobj driver uses ------------------------------------------------------
    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        data = os.pread(self._fd, max(0, min(len(buffer), self._size - self._pos)), self._pos)
        n = len(data)
        buffer[:n] = data
        if data[:4] == self._GCOL and self._pos not in self._checked:
            self._check_collection(self._pos)
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        size = self._size - self._pos if size is None or size < 0 else size
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(memoryview(buffer))])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = close  # only ever collected after HDF5 let go of it: h5py's driver holds a reference until then

    # -- variable-length data, before HDF5 allocates for it --------------------------------------------------
    # HDF5 allocates (and zeroes) the length a variable-length element's stored reference claims before it looks
    # at the heap object: one corrupted 4-byte length is a 4 GiB allocation. These read the stored references
    # themselves (an attribute's in its object header, a dataset element's in its chunk) so the reader can refuse
    # an absurd length first.

    def vlen_ref_size(self) -> int:
        return 4 + self._offset_size + 4  # sequence length, heap collection address, object index

    def vlen_lengths(self, raw: bytes) -> list[int]:
        step = self.vlen_ref_size()
        return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw) - step + 1, step)]

    def dataset_vlen_lengths(self, ds: h5py.Dataset, rows: range) -> list[int] | None:
        """Stored lengths of the variable-length elements `rows` of a 1-D dataset, read from the file itself;
        None when they are not stored plainly (compressed chunks, compact layout): HDF5 then reads them unchecked."""
        step = self.vlen_ref_size()
        dcpl = ds.id.get_create_plist()
        layout = dcpl.get_layout()
        if layout == h5py.h5d.CONTIGUOUS:
            base = ds.id.get_offset()
            return [0 if base is None else int.from_bytes(self._pread(4, base + r * step), "little") for r in rows]
        if layout != h5py.h5d.CHUNKED or dcpl.get_nfilters():
            return None
        chunk = dcpl.get_chunk()[0]
        out = []
        for r in rows:
            first = r // chunk * chunk
            info = ds.id.get_chunk_info_by_coord((first,))
            out.append(0 if info.byte_offset is None else  # never written: fill values, empty strings
                       int.from_bytes(self._pread(4, info.byte_offset + (r - first) * step), "little"))
        return out

    def attributes(self, header_addr: int) -> dict[str, tuple[int, list[int]]] | None:
        """{attribute name: (number of elements, stored lengths of its variable-length elements)} for the attributes
        kept in the object header at header_addr (HDF5's compact attribute storage). None when the header is not
        laid out that way (dense attribute storage, an unknown version): HDF5 is then left to read them unchecked."""
        if header_addr in self._attr_cache:
            return self._attr_cache[header_addr]
        try:
            found = self._parse_object_header(header_addr)
        except (IndexError, ValueError, OSError):
            found = None
        self._attr_cache[header_addr] = found
        return found

    def _pread(self, size: int, at: int) -> bytes:
        if at < 0 or size < 0 or at + size > self._size or size > 1 << 24:
            raise ValueError("a stored block lies outside the file")
        return os.pread(self._fd, size, at)

    def _parse_object_header(self, addr: int) -> dict[str, tuple[int, list[int]]] | None:
        o, n = self._offset_size, self._length_size
        head = self._pread(16, addr)
        blocks = []  # (start, end, message header size, creation-order flag known per message)
        if head[:4] == b"OHDR":
            if head[4] != 2:
                return None
            flags = head[5]
            at = addr + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
            width = 1 << (flags & 0x03)
            chunk = int.from_bytes(self._pread(width, at), "little")
            at += width
            blocks.append((at, at + chunk, 2, flags & 0x04))
        elif head[0] == 1:
            size = int.from_bytes(head[8:12], "little")
            blocks.append((addr + 16, addr + 16 + size, 1, 0))
        else:
            return None
        out: dict[str, tuple[int, list[int]]] = {}
        seen = 0
        while blocks:
            start, end, version, order = blocks.pop()
            seen += 1
            if seen > 64:
                raise ValueError("too many object header continuation blocks")
            data = self._pread(end - start, start)
            p = 0
            while True:
                if version == 1:
                    if p + 8 > len(data):
                        break
                    mtype = int.from_bytes(data[p:p + 2], "little")
                    msize = int.from_bytes(data[p + 2:p + 4], "little")
                    body = p + 8
                else:
                    hsize = 6 if order else 4
                    if p + hsize > len(data) - 4:  # the last 4 bytes are the checksum
                        break
                    mtype = data[p]
                    msize = int.from_bytes(data[p + 1:p + 3], "little")
                    body = p + hsize
                message = data[body:body + msize]
                if len(message) < msize:
                    raise ValueError("object header message runs past its block")
                if mtype == 0x0010:  # continuation: another block of messages
                    c_at = int.from_bytes(message[:o], "little")
                    c_len = int.from_bytes(message[o:o + n], "little")
                    if version == 2:
                        if self._pread(4, c_at) != b"OCHK":
                            raise ValueError("bad continuation block")
                        blocks.append((c_at + 4, c_at + c_len, 2, order))
                    else:
                        blocks.append((c_at, c_at + c_len, 1, 0))
                elif mtype == 0x0015:  # attribute info: where dense attribute storage (a fractal heap) is, if used
                    heap = message[2 + (2 if message[1] & 0x01 else 0):][:o]
                    if heap != b"\xff" * o:
                        return None  # the attributes live in the fractal heap, not in this header
                elif mtype == 0x000C:
                    name, count, lengths = self._attribute_message(message)
                    if name is not None:
                        out[name] = (count, lengths)
                p = body + msize
        return out

    def _attribute_message(self, m: bytes) -> tuple[str | None, int, list[int]]:
        """(name, number of elements, their stored variable-length lengths) of an attribute message (no lengths for
        fixed-size data); name None when the message describes its type elsewhere (shared) or is unknown."""
        version, flags = m[0], m[1]
        name_size = int.from_bytes(m[2:4], "little")
        dt_size = int.from_bytes(m[4:6], "little")
        ds_size = int.from_bytes(m[6:8], "little")
        if version == 1:
            pad = lambda x: (x + 7) & ~7  # noqa: E731
            p = 8
            name = m[p:p + name_size]
            p += pad(name_size)
            dt = m[p:p + dt_size]
            p += pad(dt_size)
            ds = m[p:p + ds_size]
            p += pad(ds_size)
        elif version in (2, 3):
            if flags & 0x03:  # shared datatype or dataspace: not described here
                return None, 0, []
            p = 8 if version == 2 else 9
            name = m[p:p + name_size]
            p += name_size
            dt = m[p:p + dt_size]
            p += dt_size
            ds = m[p:p + ds_size]
            p += ds_size
        else:
            return None, 0, []
        name = name.split(b"\0", 1)[0].decode("utf-8", "replace")
        count = self._dataspace_elements(ds)
        if not dt or dt[0] & 0x0F != 9:  # not variable-length
            return name, count, []
        return name, count, self.vlen_lengths(m[p:p + min(count, 1 << 20) * self.vlen_ref_size()])

    def _dataspace_elements(self, ds: bytes) -> int:
        version, rank = ds[0], ds[1]
        if version == 2 and ds[3] == 2:  # null dataspace
            return 0
        start = 8 if version == 1 else 4
        count = 1
        for i in range(rank):
            count *= int.from_bytes(ds[start + i * self._length_size:start + (i + 1) * self._length_size], "little")
        return count

    # -- the check ---------------------------------------------------------------------------------------------
    def _check_collection(self, at: int) -> None:
        """Walk the global heap collection at byte `at` as HDF5's H5HG deserializer does; raise when it would loop."""
        n = self._length_size
        header = os.pread(self._fd, 8 + n, at)
        if len(header) < 8 + n:
            return  # HDF5 reports a short collection itself
        size = int.from_bytes(header[8:8 + n], "little")
        if size > self.MAX_COLLECTION:
            raise OSError(f"global heap collection at byte {at} claims {size} bytes (a run's strings need at most "
                          f"{self.MAX_COLLECTION})")
        data = os.pread(self._fd, min(size, self._size - at), at)
        if len(data) < size:
            return  # beyond the end of the file: HDF5 reports it
        obj_header = 2 + 2 + 4 + n
        p = (8 + n + 7) & ~7  # H5HG_SIZEOF_HDR, aligned
        mask = (1 << 64) - 1
        while p < size:
            if p + obj_header > size:
                break  # HDF5 takes the rest as free space
            idx = int.from_bytes(data[p:p + 2], "little")
            length = int.from_bytes(data[p + 8:p + 8 + n], "little")
            need = (obj_header + ((length + 7) & ~7 & mask)) & mask if idx else length
            if need == 0 or need >= 1 << 63:  # p would not move forward (or would wrap around)
                raise OSError(f"corrupted global heap collection at byte {at}: object at byte {at + p} has "
                              f"size {length}")
            p += need
        self._checked.add(at)


_OPEN_RUNS: "weakref.WeakSet[Run]" = weakref.WeakSet()


@atexit.register
def _close_open_runs() -> None:
    # h5py's fileobj driver must not outlive the interpreter: a run left open at exit would crash HDF5's own
    # shutdown (a segfault after the Python objects it calls are gone). Close them while Python still runs.
    for run in list(_OPEN_RUNS):
        try:
            run.close()
        except Exception:
            pass


class Run:
    """A recorded run. ``upd.open_run(path)`` opens one; use it as a context manager or call ``close()``."""

    def __init__(self, path, live_timeout: float | None = None):
        self.path = os.fspath(path)
        _check_path(self.path)
        self.live = False  # True: a writer had the file open, and this reads a copy taken between two records
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            if livelock.writer_present(fd):
                self.live, live_fd = True, fd
                try:
                    fd = livelock.snapshot(live_fd, timeout=_live_timeout(live_timeout))
                except (OSError, TimeoutError, RuntimeError) as exc:
                    raise RunFileError(f"{self.path}: being written, and no complete copy of it could be taken "
                                       f"({_problem(exc)})") from None
                finally:
                    os.close(live_fd)
            try:
                self._raw = _GuardedFile(self.path, fd, snapshot=self.live)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            raise RunFileError(f"{self.path}: cannot open ({_problem(exc)})") from None
        try:
            self._file = h5py.File(self._raw, "r")
        except Exception as exc:  # h5py raises OSError for most non-HDF5 input, other types for some garbage
            self._raw.close()
            raise RunFileError(f"{self.path}: not a readable HDF5 file ({_problem(exc)})") from None
        _OPEN_RUNS.add(self)
        try:
            self._load()
        except RunFileError:
            self.close()
            raise
        except Exception as exc:  # a file that h5py opens can still be broken anywhere inside
            self.close()
            raise RunFileError(f"{self.path}: unreadable run ({_problem(exc)})") from None

    def _load(self) -> None:
        check = self._validator()
        fmt_name = check.get_attr(self._file, schema.ATTR_FORMAT, "root")
        version = check.get_attr(self._file, schema.ATTR_VERSION, "root")
        if isinstance(fmt_name, bytes):
            fmt_name = fmt_name.decode("utf-8", "replace")
        if not isinstance(fmt_name, str) or fmt_name != schema.FORMAT_NAME:
            raise RunFileError(f"{self.path}: HDF5 file but not a torch-upd run (no '{schema.ATTR_FORMAT}' attribute "
                               f"saying {schema.FORMAT_NAME!r})")
        if not _is_int(version):
            raise RunFileError(f"{self.path}: format_version attribute missing or not an integer")
        if version > schema.FORMAT_VERSION:
            raise RunFileError(f"{self.path}: written in run format version {int(version)}; this torch-upd reads "
                               f"up to version {schema.FORMAT_VERSION}: upgrade torch-upd")
        if version < 1:
            raise RunFileError(f"{self.path}: format_version {int(version)} does not exist (versions start at 1)")
        self.format_version = int(version)
        self.meta = check.json_attr(self._file, schema.ATTR_META, "run metadata", dict)
        _check_run_meta(check, self.meta)
        groups = check.child(self._file, "optimizers", "group 'optimizers'", h5py.Group)
        names = check.members(groups, "group 'optimizers'")
        for k in names:
            if not (k.isascii() and k.isdigit() and len(k) < 10 and str(int(k)) == k):
                raise check.fail("group 'optimizers'", f"member {k[:40]!r} is not an optimizer index")
        self.optimizers = [OptimizerRun(self, int(k), check.child(groups, k, f"optimizer {k}", h5py.Group), check)
                           for k in sorted(names, key=int)]
        raw = check.json_attr(self._file, "params_not_optimized", "root", list, default=[], required=False)
        if not _is_list_of_str(raw):
            raise check.fail("root", "attribute 'params_not_optimized' is not a JSON list of names")
        self.params_not_optimized = raw

    def _reading(self, what: str) -> _Reading:
        return _Reading(self.path, what, getattr(self, "_raw", None))

    def _validator(self) -> _Validator:
        return _Validator(self.path, self.size_bytes, getattr(self, "_raw", None))

    # -- overview ---------------------------------------------------------------------------------------------
    @property
    def torch_version(self) -> str:
        return self.meta.get("torch_version", "?")

    @property
    def options(self) -> dict:
        return self.meta.get("options", {})

    def param(self, name: str, optimizer: int | None = None) -> ParamRecord:
        for opt in self.optimizers:
            if (optimizer is None or opt.index == optimizer) and name in opt.param_records:
                return opt.param_records[name]
        raise KeyError(f"{self.path}: no parameter {name!r}")

    def iter_params(self) -> Iterator[ParamRecord]:
        for opt in self.optimizers:
            yield from opt.param_records.values()

    # -- tables: every DataFrame is a method call (it reads the file); see _TableMethod for the old attributes ----
    @property
    def params(self) -> "_TableMethod":
        """``run.params()``: one row per recorded parameter (optimizer, param, shape, numel, dtype, group, rows,
        kinds, state)."""
        return _TableMethod(self._params_table, "params")

    @property
    def steps(self) -> "_TableMethod":
        """``run.steps()``: one row per committed record (optimizer, record, step, backward_pass, wall_time, lr per
        param group)."""
        return _TableMethod(self._steps_table, "steps")

    @property
    def dumps(self) -> "_TableMethod":
        """``run.dumps()``: the flight-recorder dumps, one row each (optimizer, reason, trigger_step, steps,
        wall_time)."""
        return _TableMethod(lambda: pd.DataFrame(self._dump_entries(), columns=DUMP_COLUMNS), "dumps",
                            legacy=self._dump_entries)

    def _params_table(self) -> pd.DataFrame:
        rows = [{"optimizer": p.optimizer.index, "param": p.name, "shape": p.shape, "numel": p.numel,
                 "dtype": p.dtype, "group": p.param_group, "rows": p.num_rows,
                 "kinds": ",".join(p.kinds), "state": ",".join(p.state_keys)}
                for p in self.iter_params()]
        for opt in self.optimizers:  # parameters that only have per-step statistics
            with self._reading(f"the statistics table of optimizer {opt.index}"):
                stats_meta = stats_param_meta(opt)
            for name, meta in stats_meta.items():
                if name not in opt.param_records:
                    shape = tuple(meta.get("shape") or ())
                    rows.append({"optimizer": opt.index, "param": name, "shape": shape,
                                 "numel": int(np.prod(shape)) if shape else 1, "dtype": meta.get("dtype"),
                                 "group": meta.get("group"), "rows": 0, "kinds": "", "state": ""})
        return pd.DataFrame(rows, columns=["optimizer", "param", "shape", "numel", "dtype", "group", "rows",
                                           "kinds", "state"])

    def _steps_table(self) -> pd.DataFrame:
        frames = []
        for opt in self.optimizers:
            df = pd.DataFrame({"optimizer": opt.index, "record": np.arange(opt.num_records), "step": opt.steps,
                               "backward_pass": opt.backward_passes, "wall_time": opt.wall_times})
            lrs = opt.learning_rates
            for g in range(lrs.shape[1] if lrs.ndim == 2 else 0):
                df[f"lr_group{g}"] = lrs[:, g]
            frames.append(df)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
            columns=["optimizer", "record", "step", "backward_pass", "wall_time"])

    @property
    def size_bytes(self) -> int:
        """Bytes read: the file's size, or the copy's for a run being written."""
        raw = getattr(self, "_raw", None)
        return raw._size if raw is not None else os.path.getsize(self.path)

    def describe(self) -> dict:
        """What the file holds, as plain data (what `upd info` prints)."""
        optimizers = []
        for opt in self.optimizers:
            steps = opt.steps
            with self._reading(f"the statistics table of optimizer {opt.index}"):
                stats_steps, stats_meta = committed_stats_rows(opt), stats_param_meta(opt)
            optimizers.append({
                "index": opt.index, "class": opt.class_name, "records": opt.num_records,
                "stats_steps": stats_steps,
                "first_step": int(steps[0]) if len(steps) else None,
                "last_step": int(steps[-1]) if len(steps) else None,
                "param_groups": int(opt.learning_rates.shape[1]) if opt.learning_rates.ndim == 2 else 0,
                "defaults": opt.meta.get("defaults", {}),
                "params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "group": p.param_group,
                            "rows": p.num_rows, "kinds": p.kinds, "state": p.state_keys,
                            "stored_as": p.storage_dtype()} for p in opt.param_records.values()]
                + [{"name": name, "shape": list(meta.get("shape") or []), "dtype": meta.get("dtype"),
                    "group": meta.get("group"), "rows": 0, "kinds": [], "state": [], "stored_as": None}
                   for name, meta in stats_meta.items() if name not in opt.param_records],
            })
        return {"path": self.path, "live": self.live, "size_bytes": self.size_bytes,
                "format_version": self.format_version, "torch_version": self.torch_version,
                "upd_version": self.meta.get("upd_version"), "created_unix": self.meta.get("created_unix"),
                "options": self.options, "params_not_optimized": self.params_not_optimized, "optimizers": optimizers}

    # -- analysis ---------------------------------------------------------------------------------------------
    def ratios(self, block_bytes: int = DEFAULT_BLOCK_BYTES, source: str = "auto") -> pd.DataFrame:
        """Tidy DataFrame, one row per (optimizer, param, step): update:data and grad:data ratios and norms.

        update_to_data = log10(std(param_after - param) / std(param)) and grad_to_data = log10(std(grad) /
        std(param)), std as torch.std (unbiased), exactly as the seed question's loop.

        source: "tensors" computes them from the full tensors (streamed in bounded blocks: a large run is never
        loaded whole); "stats" reads the per-step statistics table; "auto" (default) uses, per optimizer, whichever
        covers more steps (statistics every step beat full tensors every 500th).
        """
        if source not in ("auto", "tensors", "stats"):
            raise ValueError(f"source must be 'auto', 'tensors' or 'stats', got {source!r}")
        with self._reading("the statistics table"):
            use_stats = {opt.index for opt in self.optimizers if committed_stats_rows(opt) and (
                source == "stats" or (source == "auto" and committed_stats_rows(opt) > opt.num_records))}
        parts = []
        if len(use_stats) < len(self.optimizers):
            tensors = ratios_frame(self, block_bytes)
            parts.append(tensors[~tensors["optimizer"].isin(use_stats)])
        if use_stats:
            with self._reading("the statistics table"):
                stats = stats_frame(self)
            numel = {(r.optimizer, r.param): r.numel for r in self._params_table().itertuples()}
            parts.append(ratios_from_stats(stats[stats["optimizer"].isin(use_stats)], numel))
        parts = [p for p in parts if len(p)]
        return pd.concat(parts, ignore_index=True) if parts else ratios_frame(self, block_bytes)

    def _dump_entries(self) -> list[dict]:
        check = self._validator()
        ds = check.dataset(self._file, "flight_dumps", "dataset 'flight_dumps'", "string", rank=1, required=False)
        if ds is None:
            return []
        check.readable(ds, ds.shape[0], "dataset 'flight_dumps'")
        check.vlen_rows(ds, range(ds.shape[0]), "dataset 'flight_dumps'")
        with self._reading("dataset 'flight_dumps'"):
            dumps = [_json_value(x) for x in ds[()]]
        if not all(isinstance(d, dict) for d in dumps):
            raise RunFileError(f"{self.path}: flight_dumps is malformed (not a list of JSON objects)")
        return dumps

    def stats(self) -> pd.DataFrame:
        """The per-step statistics table (recorded with stats_every=): one row per (optimizer, param, step) with
        mean, std, norm, absmax, zero_frac, nonfinite of param, grad, update and each optimizer-state tensor."""
        with self._reading("the statistics table"):
            return stats_frame(self)

    def close(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None and f.id.valid:
            f.close()
        raw = getattr(self, "_raw", None)
        if raw is not None:
            raw.close()  # after the HDF5 file: HDF5 reads through it until then
        _OPEN_RUNS.discard(self)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<upd.Run {self.path!r}: " + ", ".join(repr(o) for o in self.optimizers) + ">"


def _live_timeout(given: float | None) -> float:
    if given is not None:
        return float(given)
    try:
        return float(os.environ.get("UPD_LIVE_TIMEOUT", "30"))
    except ValueError:
        return 30.0


def open_run(path, live_timeout: float | None = None) -> Run:
    """Open a recorded run for reading. Raises RunFileError (one clear line) for anything that is not a usable run.

    A run that is still being written is read from a copy taken between two records (``run.live`` is True): it
    holds every record committed so far and never a half-written one. Waiting for the writer to finish the record
    in progress is bounded by `live_timeout` seconds (default: $UPD_LIVE_TIMEOUT, else 30); open the run again to
    see records committed later. The copy lives in the temporary folder (``TMPDIR``) until
    the run is closed.
    """
    return Run(path, live_timeout=live_timeout)

