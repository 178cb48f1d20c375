"""Structure checks of a run file against the schema, before the reader trusts anything in it.

A run file is untrusted input (docs/reliability.md, "Hostile and broken files"): every object must be where
``schema`` puts it, with a dtype kind and rank the schema accepts, and sizes this file can actually hold, or the
reader refuses it with one line naming the file and the object. The reader objects (reader.py) call the checks
below when they open a file; what can only be found by reading data is caught at the I/O edge (errors.Reading).
"""
from __future__ import annotations

import json
import os
import re
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
# The reading budget (docs/reliability.md, "The reading budget"): reading costs memory and time in proportion to the
# bytes a file stores, whatever shapes it declares. A dataset "stores" the bytes of the chunks actually written
# (HDF5's storage size), never more than the file's bytes on disk (a sparse file's holes hold nothing). A block read at
# once may be at most what its dataset stores, or MAX_READ_RATIO times that when a filter compresses it; everything
# read from one parameter's datasets, and from the whole file, at most MAX_READ_RATIO times what they store. Real
# tensors compress 1-2:1; deflate reaches about 1032:1 only on runs of one value: a declared shape beyond the budget
# is refused before anything is read or allocated. UPD_MAX_READ_RATIO raises it for a run that really is that uniform.
MAX_READ_RATIO = 64
SMALL_READ_BYTES = 64 << 10  # a block this small is read unchecked: a table's fresh chunk of fill values
SMALL_FILE_READ_BYTES = 64 << 20  # the whole-file budget is never below this (tiny runs, fill values)
# A file may hold up to this many times its bytes on disk: a filesystem that compresses (ZFS, btrfs) reports the
# compressed blocks. A sparse file's holes (no blocks at all) stay far beyond it.
DISK_SLACK = 4
# Tables that grow columns (param groups, statistics slots) leave the chunks of earlier rows of a late column
# unallocated: a block may declare this many times the data stored for it (chunks hold 64 or more rows).
_SPARSE = 64
# Filters that leave the size of the data as it is: a checksum, and byte shuffling (which only helps another filter).
_NON_COMPRESSING_FILTERS = frozenset({h5py.h5z.FILTER_FLETCHER32, h5py.h5z.FILTER_SHUFFLE})


def read_ratio() -> float:
    """MAX_READ_RATIO, or the user's UPD_MAX_READ_RATIO (never the file's to choose)."""
    try:
        return max(1.0, float(os.environ.get("UPD_MAX_READ_RATIO", MAX_READ_RATIO)))
    except ValueError:
        return float(MAX_READ_RATIO)


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


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at `path`, checked after it is opened: the path can be swapped
    for a FIFO or a device between check_path and the open, and a blocking open of a FIFO never returns. O_NONBLOCK
    makes that open return at once (it changes nothing for a regular file); what was opened is then checked."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunFileError(f"{path}: not a regular file")
        if st.st_size == 0:
            raise RunFileError(f"{path}: empty file, not a run file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_unix_time(value) -> bool:
    """A number datetime can show as a date (years 1..9999); NaN, infinities and 1e300 are not."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -62135596800 < value < 253402300800


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
        # Bytes the file really holds: a sparse file's holes read as zeros but store nothing.
        self.disk_bytes = min(file_size, getattr(raw, "disk_bytes", file_size))
        # What the file may hold: filesystems that compress (ZFS, btrfs) report fewer blocks than the data they keep.
        self.holds = min(file_size, self.disk_bytes * DISK_SLACK)
        self.raw = raw  # the file as HDF5 reads it (guards.GuardedFile): raw access to what HDF5 would allocate for
        self._readonly: bool | None = None  # whether the file is open read-only (asked once, by _open)
        # One object, one name: {(file number, object address): (parent's address, link name)} of every object child
        # has opened, kept with the open file (guards.GuardedFile.object_names) so that every Validator of one run
        # shares it; one entry per object, whatever link count its header states.
        names = getattr(raw, "object_names", None)
        self._names: dict = {} if names is None else names

    def fail(self, where: str, problem: str) -> RunFileError:
        return RunFileError(f"{self.path}: {where}: {problem}")

    def reading(self, where: str) -> Reading:
        return Reading(self.path, where)

    def child(self, group: h5py.Group, name: str, where: str, kind=h5py.Dataset, required: bool = True,
              links: dict | None = None):
        """group[name] as a hard-linked object of the given kind (None when absent and not required). links: the
        group's {name (bytes): link type} from link_types, when the caller looks up several members of one group."""
        with self.reading(where):
            link = link_type(group, name) if links is None else links.get(name.encode("utf-8"))
            if link is None:
                if required:
                    raise self.fail(where, "missing")
                return None
            self.hard_link(link, where)
            obj = self._open(group, name)
            info = h5py.h5o.get_info(obj.id)
            parent, _, last = name.rpartition("/")  # 'state/exp_avg' is the name 'exp_avg' in the group 'state'
            named = (h5py.h5o.get_info(group.id, parent.encode("utf-8")) if parent else h5py.h5o.get_info(group.id)
                     ).addr, last
            first = self._names.setdefault((info.fileno, info.addr), named)
        # One object, one name: each name the reader follows costs its work again (a 10 MB meta under 500 names), and
        # no writer of the format gives an object a second name. The link count in the object's header says so
        # early; what is checked is the name each object was first reached by (the count is 4 bytes of the file).
        if info.rc > 1:
            raise self.fail(where, f"is one object under {info.rc} names (hard links); a run file names each object "
                                   "once")
        if first != named:
            raise self.fail(where, "is one object under two names (hard links): the reader already reached it by "
                                   "another name; a run file names each object once")
        if not isinstance(obj, kind):
            found = "group" if isinstance(obj, h5py.Group) else "dataset" if isinstance(obj, h5py.Dataset) \
                else type(obj).__name__
            raise self.fail(where, f"is a {found}, expected a {'group' if kind is h5py.Group else 'dataset'}")
        return obj

    def hard_link(self, link: int, where: str) -> None:
        """Refuse a link that is not a hard link: never followed (an external link opens another file, soft links
        loop)."""
        if link != h5py.h5l.TYPE_HARD:
            raise self.fail(where, f"is a {_LINK_NAMES.get(link, 'link')}; a run file holds its data itself")

    def _open(self, group: h5py.Group, name: str):
        """group[name] for a one-component name already known to be a hard link, without what h5py's
        ``group[name]`` adds to each lookup (it builds a File object to learn the file's mode): 0.15 ms a lookup,
        most of the cost of opening a run of many small parameters."""
        if "/" in name:
            return group[name]
        oid = h5py.h5o.open(group.id, name.encode("utf-8"))
        otype = h5py.h5i.get_type(oid)
        if otype == h5py.h5i.GROUP:
            return h5py.Group(oid)
        if otype == h5py.h5i.DATASET:
            if self._readonly is None:  # as h5py decides it: a dataset of a read-only file caches its shape
                self._readonly = h5py.h5i.get_file_id(oid).get_intent() == h5py.h5f.ACC_RDONLY
            return h5py.Dataset(oid, readonly=self._readonly)
        return group[name]  # a named datatype (refused by the caller) or anything else: h5py's own wrapping

    def open_checked(self, group: h5py.Group, name: str):
        """group[name] for a member this validator has already checked (a hard link to an object of the expected
        kind): opened the cheap way (_open)."""
        return self._open(group, name)

    def members(self, group: h5py.Group, where: str) -> list[str]:
        with self.reading(where):
            names = list(group)
        for name in names:
            if not _is_utf8(name):  # h5py gives bytes for a name it cannot decode
                raw = name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")
                raise self.fail(where, f"member name {raw[:60]!r} is not valid UTF-8")
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

    def vlen_rows(self, ds: h5py.Dataset, rows: range, where: str, limit: int = schema.MAX_META_BYTES) -> None:
        """Before HDF5 reads strings `rows` of ds: refuse lengths it would allocate that no valid run has (longer
        than `limit` bytes)."""
        if self.raw is None or not len(rows):
            return
        with self.reading(where):
            lengths = self.raw.dataset_vlen_lengths(ds, rows)
        claimed = max(lengths or [0])
        if claimed > limit:
            raise self.fail(where, f"claims a string of {claimed} bytes (the limit is {limit})")

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

    def stored(self, ds: h5py.Dataset, where: str) -> tuple[int, bool]:
        """(bytes ds stores: its written chunks, at most the file's bytes on disk; whether a filter compresses them).
        Chunks never written read as fill values: they cost memory when read but store nothing."""
        with self.reading(where):
            dcpl = ds.id.get_create_plist()
            compresses = any(dcpl.get_filter(i)[0] not in _NON_COMPRESSING_FILTERS for i in range(dcpl.get_nfilters()))
            try:
                stored = ds.id.get_storage_size()
            except RuntimeError:
                # The size walks the whole chunk index. A writer killed while the index grew for a record it never
                # committed leaves entries that point past the end of the file (docs/reliability.md): the committed
                # chunks still read, and the file's size still bounds what this dataset can store.
                stored = self.holds
        return min(int(stored), self.holds), compresses

    def over_budget(self, what: str, need: int, stored: int, compresses: bool, at_once: bool = False) -> str:
        return (f"declares {what}: {_size(need)} to read{' at once' if at_once else ''}, but stores {_size(stored)}"
                + (" compressed" if compresses else "") + f" (the file holds {_size(self.disk_bytes)} on disk)")

    def dataset(self, group, name: str, where: str, kinds: str, rank: int | None = None, min_rank: int = 1,
                required: bool = True, links: dict | None = None) -> h5py.Dataset | None:
        """group[name] as a dataset whose dtype kind is in kinds and whose rank is rank (or at least min_rank)."""
        ds = self.child(group, name, where, h5py.Dataset, required, links)
        if ds is None:
            return None
        with self.reading(where):
            dtype, shape = ds.dtype, ds.shape
            dcpl = ds.id.get_create_plist()
            layout, external = dcpl.get_layout(), dcpl.get_external_count()
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
                 required: bool | None = None, links: dict | None = None) -> h5py.Dataset | None:
        """group[decl.name] (or group[name], for a declaration that stands for many: state keys) checked against
        its schema declaration: accepted dtype kinds and rank, present unless optional."""
        return self.dataset(group, decl.name if name is None else name, where, decl.accepts, rank=decl.rank,
                            required=decl.required if required is None else required, links=links)

    def block_bytes(self, ds: h5py.Dataset, rows: int) -> int:
        per_row = ds.dtype.itemsize
        for d in ds.shape[1:]:
            per_row *= int(d)
        return max(0, rows) * per_row

    def readable(self, ds: h5py.Dataset, rows: int, where: str, sparse: int = 1) -> int:
        """Refuse reading `rows` rows of ds in one block beyond the reading budget: more than ds stores (times
        MAX_READ_RATIO when a filter compresses it). sparse: how many times the stored data a valid file's block may
        declare (columns added late leave chunks unallocated). Returns the block's bytes."""
        need = self.block_bytes(ds, rows)
        if need <= SMALL_READ_BYTES:
            return need
        stored, compresses = self.stored(ds, where)
        if need > stored * sparse * (read_ratio() if compresses else 1):
            raise self.fail(where, self.over_budget(f"shape {ds.shape}", need, stored, compresses, at_once=True))
        self.grant(ds.name, need, where)
        return need

    def grant(self, name: str, need: int, where: str) -> None:
        """Count `need` bytes read from dataset `name` against the whole file's budget (each dataset once, at its
        largest read): overlapping chunks cannot make a small file read as many big ones."""
        if self.raw is None or not hasattr(self.raw, "grant"):
            return
        total = self.raw.grant(name, need)
        budget = max(SMALL_FILE_READ_BYTES, self.holds * read_ratio())
        if total > budget:
            raise self.fail(where, f"the file declares {_size(total)} of data to read, more than {read_ratio():g} "
                                   f"times what it can hold ({_size(self.disk_bytes)} on disk)")

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


def link_types(group: h5py.Group) -> dict[bytes, int]:
    """{name (bytes, as stored): link type} of every member of group, in one pass over its links: a parameter's
    group holds up to eight members the reader looks up, and one lookup each costs more than this pass."""
    found: dict[bytes, int] = {}

    def note(name: bytes, info) -> None:
        found[name] = info.type

    group.id.links.iterate(note, info=True)
    return found


def link_type(group: h5py.Group, name: str) -> int | None:
    """The type of the link group/name (h5py.h5l.TYPE_*), None when there is none; follows no link but hard links
    (a path like 'state/exp_avg' is resolved one hard-linked component at a time)."""
    links = group.id.links
    if "/" not in name:  # one component (the common case): one lookup
        key = name.encode("utf-8")
        return links.get_info(key).type if links.exists(key) else None
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
    if not isinstance(text, str):
        return False
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
    if not isinstance(value, (int, float, bool, type(None))) \
            and (not isinstance(raw, str) or _SURROGATE_ESCAPE.search(raw) is not None) \
            and not _is_utf8(json.dumps(value, ensure_ascii=False)):
        raise ValueError("text holds an invalid Unicode escape (a lone surrogate)")
    return value


def event_entry(entry, where: str) -> dict:
    """One events-table entry checked (docs/format.md, ``events``): a JSON object with EVENT_FIELDS, integers for
    optimizer and step, strings for kind and param, a number or null for value, a number for wall_time; returned
    with those fields only. RunFileError otherwise."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(entry, dict):
        raise RunFileError(f"{where} is not a JSON object")
    checks = {"optimizer": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "step": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "kind": lambda v: isinstance(v, str), "param": lambda v: isinstance(v, str),
              "value": lambda v: v is None or number(v), "wall_time": number}
    for name in schema.EVENT_FIELDS:
        if name not in entry or not checks[name](entry[name]):
            raise RunFileError(f"{where}: {name!r} is missing or not what an event holds")
    return {name: entry[name] for name in schema.EVENT_FIELDS}


# Valid UTF-8 text parses to a lone surrogate only through a \uD800..\uDFFF escape: without one (a search at C
# speed) the parsed value need not be encoded again to be checked (2.3 s of `upd info` on 200,000 names).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
    if created is not None and not is_unix_time(created):
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
    problem = meta_problem(meta)
    if problem:
        raise check.fail(where, f"metadata {problem}")
    return meta


def meta_problem(meta: dict) -> str | None:
    """Why a parameter's metadata (its group's, or its parameter index entry's) is not acceptable, or None."""
    problem = shape_problem(meta.get("shape"))
    if problem is None and not (meta.get("dtype") is None or isinstance(meta.get("dtype"), str)):
        problem = "dtype is not a string"
    for key in ("group", "index_in_group"):
        value = meta.get(key)
        if problem is None and value is not None and not (is_int(value) and value >= 0):
            problem = f"{key} {str(value)[:40]} is not a non-negative integer"
    return problem


def record_index(check: Validator, group: h5py.Group, where: str, links: dict | None = None,
                 committed: int | None = None) -> np.ndarray:
    """A parameter's record index: for each row, the record it belongs to, non-negative and increasing.
    links: the group's link_types, when the caller has them. committed: the optimizer's committed records; the
    rows from the first that belongs to no committed record on are cut (rows of a record being written at a kill:
    the dataset's length can include a row whose value never reached the disk and reads as the fill value)."""
    at = f"{where}: dataset '{schema.RECORD_INDEX}'"
    index_ds = check.declared(group, schema.PARAMETER.dataset(schema.RECORD_INDEX), at, links=links)
    # A parameter has at most one row per committed record: the rows past that many belong to records never
    # committed, and are not read at all (after a kill their chunk index can point past the end of the file).
    check.readable(index_ds, index_ds.shape[0], at)  # what it declares, read or not: a file that lies is refused
    rows = index_ds.shape[0] if committed is None else min(index_ds.shape[0], committed)
    with check.reading(at):
        # read straight into an array of its (checked: native integer, rank 1) dtype; ds[:rows] costs 0.2 ms more
        records = np.empty((rows,), index_ds.dtype)
        if rows:
            selected = index_ds.id.get_space()
            selected.select_hyperslab((0,), (rows,))
            index_ds.id.read(h5py.h5s.create_simple((rows,)), selected, records)
        records = records.astype(np.int64, copy=False)
    if committed is not None and len(records):
        beyond = (records >= committed) | (np.arange(len(records)) > 0) & (records <= np.roll(records, 1))
        if beyond.any():
            cut = int(np.argmax(beyond))
            tail = records[cut:]
            # what a kill leaves: rows of records not committed, or never written (the fill value, 0); anything
            # else past the committed rows is a file that lies about its rows, refused below
            if ((tail >= committed) | (tail == 0)).all():
                records = records[:cut]
    if len(records) and (records.min() < 0 or (np.diff(records) < 0).any()):
        raise check.fail(at, "record indices are negative or not in increasing order")
    return records


class ParamDatasets:
    """A parameter's tensor and state datasets, checked when they are first read, not when the file is opened.

    Opening a run touches, per parameter, only its metadata, record index and state keys: HDF5 opens a dataset in
    about 0.1 ms, and a 5,000-parameter run has 40,000 of them, which `upd info` never reads. The first read (or the
    first dtype asked for) checks every dataset of the parameter at once: its kind of dtype and rank, its trailing
    shape, at least one row per committed record, its torch_dtype, and the reading budget of the parameter as a
    whole (all rows the reader may read, against what its datasets store). Links are checked at open: a soft or
    external link is refused before anything follows it.

    Behaves as {kind: storage torch dtype name} for the tensor kinds present; ``state_keys`` and ``state_dtypes``
    ({key: storage dtype}) are the optimizer state's."""

    def __init__(self, check: Validator, group: h5py.Group, where: str, shape: tuple, num_rows: int,
                 links: dict | None = None, listed_dtypes: dict | None = None):
        self._check, self._group, self._where = check, group, where
        self._listed_dtypes = listed_dtypes  # {kind: storage dtype} as the parameter index lists them, if it does
        self._shape, self._num_rows = shape, num_rows
        # the group's {name: link type} (link_types), one pass over its links instead of a lookup per member
        if links is None:
            with check.reading(where):
                links = link_types(group)
        self._links = links
        self._kinds = [k for k in schema.TENSOR_KINDS if self._linked(k, f"{where}: dataset {k!r}")]
        self._dtypes: dict | None = None
        self._state_dtypes: dict = {}
        at = f"{where}: group '{schema.STATE_GROUP}'"
        state = check.child(group, schema.STATE_GROUP, at, h5py.Group, required=False, links=links)  # not kept open
        keys = [] if state is None else check.json_attr(state, schema.STATE_KEYS, at, list, default=[],
                                                        required=False)
        if not is_list_of_str(keys):
            raise check.fail(at, f"attribute '{schema.STATE_KEYS}' is not a JSON list of strings")
        self.state_keys = list(keys)
        if keys and not self._linked(schema.STATE_PRESENT, f"{where}: dataset '{schema.STATE_PRESENT}'"):
            raise check.fail(f"{where}: dataset '{schema.STATE_PRESENT}'", "missing")
        self.state_dtypes = _StateDtypes(self)

    def _linked(self, name: str, where: str) -> bool:
        link = self._links.get(name.encode("utf-8"))
        if link is not None and link != h5py.h5l.TYPE_HARD:
            raise self._check.fail(where, f"is a {_LINK_NAMES.get(link, 'link')}; a run file holds its data itself")
        return link is not None

    def __contains__(self, kind) -> bool:
        return kind in self._kinds

    def __iter__(self):
        return iter(self._kinds)

    def __getitem__(self, kind: str) -> str | None:
        if kind not in self._kinds:
            raise KeyError(kind)
        return self.checked()[kind]

    def dtype_of(self, kind: str) -> str | None:
        """The storage dtype of one kind, checking that dataset's dtype and row size alone (what `upd info` shows)."""
        if self._dtypes is not None:
            return self._dtypes[kind]
        at = f"{self._where}: dataset {kind!r}"
        ds = self._check.declared(self._group, schema.PARAMETER.dataset(kind), at, links=self._links)
        self._check.readable(ds, 1 if self._num_rows else 0, at)  # declared rows it does not store: refused early
        self._budget([(ds, min(self._num_rows, ds.shape[0]), at)])
        return self._check.tensor_dtype(ds, at)

    def checked(self) -> dict:
        """Check every dataset of the parameter (once) and return {kind: storage dtype}."""
        if self._dtypes is not None:
            return self._dtypes
        check, where, rows = self._check, self._where, self._num_rows
        dtypes: dict[str, str | None] = {}
        reads = []  # (dataset, rows the reader may read, where)
        for kind in self._kinds:
            at = f"{where}: dataset {kind!r}"
            ds = check.declared(self._group, schema.PARAMETER.dataset(kind), at, required=True, links=self._links)
            if ds.shape[1:] != self._shape:
                raise check.fail(at, f"has shape {ds.shape}: rows of {list(ds.shape[1:])}, but the parameter's shape "
                                     f"is {list(self._shape)}")
            if ds.shape[0] < rows:
                raise check.fail(at, f"has {ds.shape[0]} rows, fewer than the parameter's {rows} committed records")
            check.readable(ds, 1 if rows else 0, at)
            dtypes[kind] = check.tensor_dtype(ds, at)
            if self._listed_dtypes is not None and dtypes[kind] != self._listed_dtypes.get(kind):
                raise check.fail(at, f"has torch_dtype {dtypes[kind]}, but the parameter index lists "
                                     f"{self._listed_dtypes.get(kind)}")
            reads.append((ds, rows, at))
        if self.state_keys:
            decl = schema.STATE.datasets[0]
            state = check.open_checked(self._group, schema.STATE_GROUP)  # a hard-linked group: checked at __init__
            for key in self.state_keys:
                at = f"{where}: state {key!r}"
                ds = check.declared(state, decl, at, name=key)
                if ds is not None:
                    check.readable(ds, 1, at)
                    self._state_dtypes[key] = check.tensor_dtype(ds, at)
                    reads.append((ds, min(rows, ds.shape[0]), at))
            at = f"{where}: dataset '{schema.STATE_PRESENT}'"
            present = check.declared(self._group, schema.PARAMETER.dataset(schema.STATE_PRESENT), at, required=True,
                                     links=self._links)
            check.readable(present, 1, at)
            reads.append((present, min(rows, present.shape[0]), at))
        self._budget(reads)
        self._dtypes = dtypes
        return dtypes

    def _budget(self, reads: list) -> None:
        """Everything the reader may read from this parameter: at most MAX_READ_RATIO times what it stores (rows a
        valid run never wrote, e.g. a gradient missing at some steps, read as fill values and are allowed for)."""
        check = self._check
        need = stored = 0
        compressed = False
        for ds, rows, at in reads:
            need += check.block_bytes(ds, rows)
            got, compresses = check.stored(ds, at)
            stored += got
            compressed |= compresses
        stored = min(stored, check.holds)
        if need > max(SMALL_READ_BYTES, stored * read_ratio()):
            ds, rows, at = reads[0]
            what = f"{rows} rows of {list(ds.shape[1:])}" if len(reads) == 1 else \
                f"{len(reads)} datasets of up to {self._num_rows} rows"
            raise check.fail(at if len(reads) == 1 else self._where, check.over_budget(what, need, stored, compressed))
        for ds, rows, at in reads:
            check.grant(ds.name, check.block_bytes(ds, rows), at)


class _StateDtypes:
    """{state key: storage dtype} of a ParamDatasets, checked at the first lookup."""

    def __init__(self, datasets: ParamDatasets):
        self._datasets = datasets

    def get(self, key: str, default=None):
        self._datasets.checked()
        return self._datasets._state_dtypes.get(key, default)

    def __getitem__(self, key: str):
        self._datasets.checked()
        return self._datasets._state_dtypes[key]

    def __contains__(self, key) -> bool:
        self._datasets.checked()
        return key in self._datasets._state_dtypes


def tensor_dataset(check: Validator, group: h5py.Group, name: str, where: str) -> str | None:
    """The storage dtype of a tensor dataset outside the three kinds (e.g. 'state/exp_avg'), checked like them."""
    ds = check.dataset(group, name, where, schema.TENSOR_NUMBERS)
    check.readable(ds, 1, where)
    return check.tensor_dtype(ds, where)


def param_groups(check: Validator, params: list, groups: int, where: str) -> None:
    """Every parameter with rows belongs to a param group the record table has an lr column for."""
    for p in params:
        if p.num_rows and (p.param_group or 0) >= groups:
            raise check.fail(f"{where}: parameter {p.name!r}", f"param group {p.param_group or 0} does not exist "
                                                               f"({schema.RECORDS}/{schema.LR} has {groups} group "
                                                               f"column(s))")


class StatsSteps(NamedTuple):
    """What the statistics table says of each committed row's step, read whole (the values are read in blocks);
    the ``hparams`` texts are read when asked for (``hparams``: their dataset)."""

    steps: np.ndarray
    backward_passes: np.ndarray
    wall_times: np.ndarray
    learning_rates: np.ndarray
    hparams: h5py.Dataset | None
    # The table's attributes, parsed and checked once per open: a statistics-only run of 1.1M names parsed each of
    # them about ten times (the reader, describe(), the tables), most of `upd info`'s 43 s.
    params: list = []  # STATS_PARAMS: the table's parameter names, in slot order
    columns: list = []  # STATS_COLUMNS
    param_meta: dict = {}  # STATS_PARAM_META: {name: meta}; shared, never to be changed by a caller


NO_STATS = StatsSteps(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros((0, 0)), None)


def stats_table(check: Validator, group: h5py.Group, where: str) -> StatsSteps:
    """The statistics table, when there is one, as far as stats_table reads it: attributes, dtypes, ranks and block
    sizes; its committed rows' steps, backward passes, wall times and learning rates."""
    with check.reading(f"{where}: group '{schema.STATS}'"):
        if link_type(group, schema.STATS) is None:  # the link itself: never follows it
            return NO_STATS
    table = schema.STATS_TABLE
    st = check.child(group, schema.STATS, f"{where}: group '{schema.STATS}'", h5py.Group)
    with check.reading(f"{where}: group '{schema.STATS}'"):
        if link_type(st, schema.VALUES) is None:
            return NO_STATS  # no statistics row written yet: the reader ignores the table
    at = f"{where}: statistics table"
    step = check.declared(st, table.dataset(schema.STEP), f"{at} '{schema.STEP}'")
    n = int(step.shape[0])
    check.readable(step, n, f"{at} '{schema.STEP}'")
    per_step = {}
    for name in (schema.BACKWARD_PASS, schema.WALL_TIME, schema.HPARAMS):
        ds = per_step[name] = check.declared(st, table.dataset(name), f"{at} '{name}'")
        if ds.shape[0] < n:
            raise check.fail(f"{at} '{name}'", f"has {ds.shape[0]} rows, fewer than the {n} committed steps")
        if name != schema.HPARAMS:
            check.readable(ds, n, f"{at} '{name}'")
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
    with check.reading(at):
        lr_rows = lr[:n] if lr.shape[0] >= n else np.full((n, lr.shape[1]), np.nan)
        return StatsSteps(step[:n].astype(np.int64, copy=False),
                          per_step[schema.BACKWARD_PASS][:n].astype(np.int64, copy=False),
                          per_step[schema.WALL_TIME][:n].astype(np.float64, copy=False), lr_rows,
                          per_step[schema.HPARAMS], params, columns, meta)
