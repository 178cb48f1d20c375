"""Structure checks of a run file against the schema, before the reader trusts anything in it.

A run file is untrusted input (docs/reliability.md, "Hostile and broken files"): every object must be where
``schema`` puts it, with a dtype kind and rank the schema accepts, and sizes this file can actually hold, or the
reader refuses it with one line naming the file and the object. The reader objects (reader.py) call the checks
below when they open a file; what can only be found by reading data is caught at the I/O edge (errors.Reading).
"""
from __future__ import annotations

import json
import os
import stat
from typing import NamedTuple

import h5py
import numpy as np

from . import encoding, schema
from .errors import Reading, RunFileError, phrase
from .stats_table import STATS_BLOCK_ROWS

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


def check_path(path: str) -> None:
    """Refuse what is not a readable, non-empty regular file before anything opens it (a FIFO would block)."""
    if not os.path.exists(path):
        raise RunFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise RunFileError(f"{path}: is a directory, not a run file")
    if not os.access(path, os.R_OK):
        raise RunFileError(f"{path}: permission denied")
    try:
        st = os.stat(path)
    except OSError as exc:
        raise RunFileError(f"{path}: cannot stat the file ({phrase(exc)})") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
        raise RunFileError(f"{path}: not a regular file")
    if st.st_size == 0:
        raise RunFileError(f"{path}: empty file, not a run file")


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_list_of_str(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def shape_problem(shape) -> str | None:
    """Why a shape from JSON metadata is not a sane tensor shape, or None when it is (None = no shape)."""
    if shape is None:
        return None
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
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


class Validator:
    """Structure checks of one open file: every object is where the format puts it, with the expected kind of
    dtype and rank, and sizes this file can actually hold. Raises RunFileError naming the file and the object."""

    def __init__(self, path: str, file_size: int, raw=None):
        self.path = path
        self.file_size = file_size
        self.raw = raw  # the file as HDF5 reads it (guards.GuardedFile): raw access to what HDF5 would allocate for
        self._filtered: dict = {}  # dataset id -> has HDF5 filters (compression)

    def fail(self, where: str, problem: str) -> RunFileError:
        return RunFileError(f"{self.path}: {where}: {problem}")

    def reading(self, where: str) -> Reading:
        return Reading(self.path, where)

    def child(self, group: h5py.Group, name: str, where: str, kind=h5py.Dataset, required: bool = True):
        """group[name] as a hard-linked object of the given kind (None when absent and not required)."""
        with self.reading(where):
            link = link_type(group, name)
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
            value = json_value(raw)
        except (ValueError, RecursionError, MemoryError) as exc:  # RecursionError: "[[[[..." nested too deep
            raise self.fail(where, f"attribute {name!r} is not valid JSON text ({phrase(exc)})") from None
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

    def declared(self, group, decl: schema.Dataset, where: str, name: str | None = None,
                 required: bool | None = None) -> h5py.Dataset | None:
        """group[decl.name] (or group[name], for a declaration that stands for many: state keys) checked against
        its schema declaration: accepted dtype kinds and rank, present unless optional."""
        return self.dataset(group, decl.name if name is None else name, where, decl.accepts, rank=decl.rank,
                            required=decl.required if required is None else required)

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
        raw = self.get_attr(ds, schema.ATTR_TORCH_DTYPE, where)
        if raw is None:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        if not isinstance(raw, str):
            raise self.fail(where, f"attribute 'torch_dtype' is {type(raw).__name__}, expected a dtype name")
        expected = encoding.numpy_dtype_of(raw)
        if expected is None:
            raise self.fail(where, f"attribute 'torch_dtype' {raw[:40]!r} is not a torch dtype this reader knows")
        if ds.dtype != expected:
            raise self.fail(where, f"holds {ds.dtype} data but its torch_dtype says {raw}")
        return raw


_LINK_NAMES = {h5py.h5l.TYPE_SOFT: "soft link", h5py.h5l.TYPE_EXTERNAL: "link to another file"}


def link_type(group: h5py.Group, name: str) -> int | None:
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


def json_value(raw):
    """encoding.from_json, refusing text that is not valid UTF-8 (it could not be printed or written back)."""
    if isinstance(raw, str) and not _is_utf8(raw):
        raise ValueError("text is not valid UTF-8")
    value = encoding.from_json(raw)
    if not isinstance(value, (int, float, bool, type(None))) and not _is_utf8(json.dumps(value, ensure_ascii=False)):
        raise ValueError("text holds an invalid Unicode escape (a lone surrogate)")
    return value


_KIND_NAMES = {schema.INTEGERS: "integers", schema.NUMBERS: "numbers", schema.FLOATS: "floats",
               schema.TENSOR_NUMBERS: "numbers", schema.MASK: "integers"}


def _size(nbytes: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} bytes"


# -- the structure, group by group (schema.py declares it; docs/format.md describes it) ---------------------------

def format_version(check: Validator, file: h5py.File) -> int:
    """The root's format name and version: a torch-upd run of a version this reader knows."""
    fmt_name = check.get_attr(file, schema.ATTR_FORMAT, "root")
    version = check.get_attr(file, schema.ATTR_VERSION, "root")
    if isinstance(fmt_name, bytes):
        fmt_name = fmt_name.decode("utf-8", "replace")
    if not isinstance(fmt_name, str) or fmt_name != schema.FORMAT_NAME:
        raise RunFileError(f"{check.path}: HDF5 file but not a torch-upd run (no '{schema.ATTR_FORMAT}' attribute "
                           f"saying {schema.FORMAT_NAME!r})")
    if not is_int(version):
        raise RunFileError(f"{check.path}: {schema.ATTR_VERSION} attribute missing or not an integer")
    if version > schema.FORMAT_VERSION:
        raise RunFileError(f"{check.path}: written in run format version {int(version)}; this torch-upd reads "
                           f"up to version {schema.FORMAT_VERSION}: upgrade torch-upd")
    if version < 1:
        raise RunFileError(f"{check.path}: {schema.ATTR_VERSION} {int(version)} does not exist (versions start at 1)")
    return int(version)


def run_meta(check: Validator, file: h5py.File) -> dict:
    """The root metadata, with the types of the fields readers use (`upd info`, `upd verify`) checked."""
    meta = check.json_attr(file, schema.ATTR_META, "run metadata", dict)
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
    elif not is_list_of_str(options.get("what", [])):
        problem = "'options.what' is not a list of strings"
    if problem:
        raise check.fail("run metadata", problem)
    return meta


def optimizer_names(check: Validator, file: h5py.File) -> tuple[h5py.Group, list[str]]:
    """The optimizers group and its members' names, in index order; every name an optimizer index."""
    where = f"group '{schema.OPTIMIZERS}'"
    groups = check.child(file, schema.OPTIMIZERS, where, h5py.Group)
    names = check.members(groups, where)
    for k in names:
        if not (k.isascii() and k.isdigit() and len(k) < 10 and str(int(k)) == k):
            raise check.fail(where, f"member {k[:40]!r} is not an optimizer index")
    return groups, sorted(names, key=int)


def params_not_optimized(check: Validator, file: h5py.File) -> list[str]:
    names = check.json_attr(file, schema.ATTR_PARAMS_NOT_OPTIMIZED, "root", list, default=[], required=False)
    if not is_list_of_str(names):
        raise check.fail("root", f"attribute '{schema.ATTR_PARAMS_NOT_OPTIMIZED}' is not a JSON list of names")
    return names


def optimizer_meta(check: Validator, group: h5py.Group, where: str) -> dict:
    meta = check.json_attr(group, schema.ATTR_META, where, dict)
    if not isinstance(meta.get("class", "?"), str) or not is_list_of_str(meta.get("mro", [])):
        raise check.fail(where, "metadata 'class' is not a string or 'mro' not a list of strings")
    return meta


class RecordTable(NamedTuple):
    """The record table as the reader holds it: the columns every read needs, read whole; every declared column's
    dataset (None for an optional one the file lacks), for the text columns read one row at a time."""

    num_records: int
    steps: np.ndarray
    backward_passes: np.ndarray
    wall_times: np.ndarray
    learning_rates: np.ndarray
    datasets: dict


def record_table(check: Validator, group: h5py.Group, where: str) -> RecordTable:
    """The committed rows of an optimizer's record table: every declared column present (unless optional) with
    its dtype kind and rank, at least as long as the commit column, and small enough to read whole."""
    table = schema.RECORD_TABLE
    records = check.child(group, schema.RECORDS, f"{where}: group '{schema.RECORDS}'", h5py.Group)
    rec = f"{where}: dataset '{schema.RECORDS}/%s'"
    commit = table.dataset(schema.COMMIT_COLUMN)
    step_ds = check.declared(records, commit, rec % commit.name)
    num_records = int(step_ds.shape[0])
    found = {commit.name: step_ds}
    for col in table.datasets:
        if col is commit or not col.required:
            continue
        ds = found[col.name] = check.declared(records, col, rec % col.name)
        if ds.shape[0] < num_records:
            raise check.fail(rec % col.name, f"has {ds.shape[0]} rows, fewer than the {num_records} committed "
                                             f"steps ({schema.RECORDS}/{commit.name})")
    for col in table.datasets:  # the numeric columns are read whole: refuse sizes this file cannot hold
        if col.name in found and col.dtype != schema.STRING:
            sparse = _SPARSE if col.rank > 1 else 1
            check.readable(found[col.name], num_records, rec % col.name, sparse=sparse)
    for col in table.datasets:
        if not col.required:
            found[col.name] = check.declared(records, col, rec % col.name)
    with check.reading(f"{where}: the record table"):
        return RecordTable(num_records, found[schema.STEP][()].astype(np.int64, copy=False),
                           found[schema.BACKWARD_PASS][:num_records], found[schema.WALL_TIME][:num_records],
                           found[schema.LR][:num_records], found)


def param_meta(check: Validator, group: h5py.Group, where: str) -> dict:
    """A parameter's metadata: a sane shape, a dtype name, non-negative group and index."""
    meta = check.json_attr(group, schema.ATTR_META, where, dict)
    problem = shape_problem(meta.get("shape"))
    if problem is None and not (meta.get("dtype") is None or isinstance(meta.get("dtype"), str)):
        problem = "dtype is not a string"
    for key in ("group", "index_in_group"):
        value = meta.get(key)
        if problem is None and value is not None and not (is_int(value) and value >= 0):
            problem = f"{key} {str(value)[:40]} is not a non-negative integer"
    if problem:
        raise check.fail(where, f"metadata {problem}")
    return meta


def record_index(check: Validator, group: h5py.Group, where: str) -> np.ndarray:
    """A parameter's record index: for each row, the record it belongs to, non-negative and increasing."""
    at = f"{where}: dataset '{schema.RECORD_INDEX}'"
    index_ds = check.declared(group, schema.PARAMETER.dataset(schema.RECORD_INDEX), at)
    check.readable(index_ds, index_ds.shape[0], at)
    with check.reading(at):
        records = index_ds[()].astype(np.int64, copy=False)
    if len(records) and (records.min() < 0 or (np.diff(records) < 0).any()):
        raise check.fail(at, "record indices are negative or not in increasing order")
    return records


def tensor_storage(check: Validator, group: h5py.Group, where: str, shape: tuple, num_rows: int) -> dict:
    """{kind: storage torch dtype name} of the parameter's tensor datasets that are present: rows of the
    parameter's shape, at least one per committed row, a torch_dtype matching the stored numpy dtype."""
    storage: dict[str, str | None] = {}
    for kind in schema.TENSOR_KINDS:
        at = f"{where}: dataset {kind!r}"
        ds = check.declared(group, schema.PARAMETER.dataset(kind), at)
        if ds is None:
            continue
        if ds.shape[1:] != shape:
            raise check.fail(at, f"has shape {ds.shape}: rows of {list(ds.shape[1:])}, but the parameter's shape is "
                                 f"{list(shape)}")
        if ds.shape[0] < num_rows:
            raise check.fail(at, f"has {ds.shape[0]} rows, fewer than the parameter's {num_rows} committed records")
        check.readable(ds, 1 if num_rows else 0, at)
        storage[kind] = check.tensor_dtype(ds, at)
    return storage


def tensor_dataset(check: Validator, group: h5py.Group, name: str, where: str) -> str | None:
    """The storage dtype of a tensor dataset outside the three kinds (e.g. 'state/exp_avg'), checked like them."""
    ds = check.dataset(group, name, where, schema.TENSOR_NUMBERS)
    check.readable(ds, 1, where)
    return check.tensor_dtype(ds, where)


def state_storage(check: Validator, group: h5py.Group, where: str) -> tuple[list[str], dict]:
    """(state keys in state_present's column order, {key: storage torch dtype name}) of a parameter. A key's
    dataset may be absent: only an error once a committed row says it is present (ParamRecord.state_at)."""
    at = f"{where}: group '{schema.STATE_GROUP}'"
    state = check.child(group, schema.STATE_GROUP, at, h5py.Group, required=False)
    if state is None:
        return [], {}
    keys = check.json_attr(state, schema.STATE_KEYS, at, list, default=[], required=False)
    if not is_list_of_str(keys):
        raise check.fail(at, f"attribute '{schema.STATE_KEYS}' is not a JSON list of strings")
    dtypes: dict[str, str | None] = {}
    decl = schema.STATE.datasets[0]
    for key in keys:
        ds = check.declared(state, decl, f"{where}: state {key!r}", name=key)
        if ds is not None:
            check.readable(ds, 1, f"{where}: state {key!r}")
            dtypes[key] = check.tensor_dtype(ds, f"{where}: state {key!r}")
    if keys:
        at = f"{where}: dataset '{schema.STATE_PRESENT}'"
        present = check.declared(group, schema.PARAMETER.dataset(schema.STATE_PRESENT), at, required=True)
        check.readable(present, 1, at)
    return list(keys), dtypes


def param_groups(check: Validator, params: list, groups: int, where: str) -> None:
    """Every parameter with rows belongs to a param group the record table has an lr column for."""
    for p in params:
        if p.num_rows and (p.param_group or 0) >= groups:
            raise check.fail(f"{where}: parameter {p.name!r}", f"param group {p.param_group or 0} does not exist "
                                                               f"({schema.RECORDS}/{schema.LR} has {groups} group "
                                                               f"column(s))")


def stats_table(check: Validator, group: h5py.Group, where: str) -> None:
    """The statistics table, when there is one, as far as stats_table reads it: attributes, dtypes, ranks and block
    sizes."""
    with check.reading(f"{where}: group '{schema.STATS}'"):
        if link_type(group, schema.STATS) is None:  # the link itself: never follows it
            return
    table = schema.STATS_TABLE
    st = check.child(group, schema.STATS, f"{where}: group '{schema.STATS}'", h5py.Group)
    with check.reading(f"{where}: group '{schema.STATS}'"):
        if link_type(st, schema.VALUES) is None:
            return  # no statistics row written yet: the reader ignores the table
    at = f"{where}: statistics table"
    step = check.declared(st, table.dataset(schema.STEP), f"{at} '{schema.STEP}'")
    n = int(step.shape[0])
    check.readable(step, n, f"{at} '{schema.STEP}'")
    lr = check.declared(st, table.dataset(schema.LR), f"{at} '{schema.LR}'")
    check.readable(lr, min(n, lr.shape[0]), f"{at} '{schema.LR}'", sparse=_SPARSE)
    values = check.declared(st, table.dataset(schema.VALUES), f"{at} '{schema.VALUES}'")
    if values.shape[0] < n:
        raise check.fail(f"{at} '{schema.VALUES}'", f"has {values.shape[0]} rows, fewer than the {n} committed steps")
    check.readable(values, min(n, STATS_BLOCK_ROWS), f"{at} '{schema.VALUES}'", sparse=_SPARSE)
    params = check.json_attr(st, schema.STATS_PARAMS, at, list)
    columns = check.json_attr(st, schema.STATS_COLUMNS, at, list)
    meta = check.json_attr(st, schema.STATS_PARAM_META, at, dict, default={}, required=False)
    if not (is_list_of_str(params) and is_list_of_str(columns)) or len(set(params)) < len(params) \
            or len(set(columns)) < len(columns):
        raise check.fail(at, f"attributes '{schema.STATS_PARAMS}' and '{schema.STATS_COLUMNS}' must be JSON lists of "
                             "distinct names")
    if len(columns) < values.shape[2]:
        raise check.fail(at, f"'{schema.VALUES}' has {values.shape[2]} columns but attribute "
                             f"'{schema.STATS_COLUMNS}' names {len(columns)}")
    for name, m in meta.items():
        problem = "is not an object" if not isinstance(m, dict) else shape_problem(m.get("shape"))
        if problem is None and not (m.get("group") is None or (is_int(m["group"]) and m["group"] >= 0)):
            problem = "group is not a non-negative integer"
        if problem is None and not (m.get("dtype") is None or isinstance(m["dtype"], str)):
            problem = "dtype is not a string"
        if problem:
            raise check.fail(at, f"{schema.STATS_PARAM_META} of {str(name)[:80]!r}: {problem}")
