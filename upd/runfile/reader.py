"""The reader objects: lazy, committed-records-only access to what the recorder wrote.

``Run`` opens a file (a copy taken between two records when it is being written, see livelock.py), reads it through
guards.GuardedFile, and checks its structure with validate.py before trusting it; ``OptimizerRun`` and
``ParamRecord`` then read data on demand, each read at the I/O edge (errors.Reading). Every problem with the file
is a RunFileError of one line.
"""
from __future__ import annotations

import difflib
import functools
import os
from functools import cached_property
from typing import TYPE_CHECKING, Iterator

import h5py
import numpy as np
import pandas as pd

from .. import lifetime
from . import encoding, livelock, param_index, schema, validate
from .errors import Reading, RunFileError, phrase
from .guards import GuardedFile
from .ratio_table import ratios_table
from .scalars_table import KEY_COLUMNS as SCALAR_KEY_COLUMNS, scalars_frame
from .stats_table import committed_stats_rows, hparams_rows, stats_frame, stats_param_meta, stats_state_keys
from .step_table import model_order, step_frame
from .validate import Validator, check_path, event_entry, json_value, link_type

if TYPE_CHECKING:
    import torch

__all__ = ["Run", "OptimizerRun", "ParamRecord", "RunFileError", "open_run"]

# Rows read at once when streaming a parameter's history: bounds memory on large runs.
DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024
# HDF5's metadata cache of an open run (object headers, group indexes): see _bound_metadata_cache.
METADATA_CACHE_BYTES = 4 * 1024 * 1024
# Parameters whose datasets a run keeps open for read_part (Run._handles_of): an open dataset costs HDF5 about 70 KB,
# and a pass over every parameter of a 5,000-parameter run kept 15,000 of them open (1.7 GB).
KEPT_OPEN_PARAMS = 2

DUMP_COLUMNS = ["optimizer", "reason", "trigger_step", "steps", "wall_time"]
EVENT_COLUMNS = list(schema.EVENT_FIELDS)

_HPARAMS = f"{schema.RECORDS}/{schema.HPARAMS}"
_CLOSURE_LOSSES = f"{schema.RECORDS}/{schema.CLOSURE_LOSSES}"


class ParamHistory:
    """What every parameter's recorded history offers on top of ``read``: streaming it in bounded blocks. Shared by
    one file's ParamRecord and a distributed job's JobParam (stitched from several files)."""

    def block_rows(self, block_bytes: int = DEFAULT_BLOCK_BYTES, kinds: int = 3) -> int:
        per_row = max(1, self.numel * 8 * kinds)  # float64 working copies dominate
        return max(1, block_bytes // per_row)

    def iter_blocks(self, kinds, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[tuple[slice, dict]]:
        """Yield (row slice, {kind: tensor}) over the whole history, a bounded number of rows at a time."""
        step = self.block_rows(block_bytes, max(1, len(kinds)))
        for start in range(0, self.num_rows, step):
            rows = slice(start, min(start + step, self.num_rows))
            yield rows, {k: self.read(k, rows) for k in kinds if self._has(k)}


class ParamRecord(ParamHistory):
    """One parameter's recorded history inside one optimizer."""

    def __init__(self, optimizer: "OptimizerRun", name: str, group, check: Validator | None = None,
                 listed: param_index.Listed | None = None):
        """group: the parameter's h5py group; or, with `listed` (its entry in the parameter index), a function that
        opens it, called when the parameter's data is first read (listing it reads nothing of its group)."""
        self.optimizer = optimizer
        self.name = name
        self._check = check or optimizer.run._validator()
        self._where = f"parameter {name!r} of optimizer {optimizer.index}"
        self._listed = listed
        self.meta = validate.param_meta(self._check, group, self._where) if listed is None else listed.meta
        self.shape = tuple(int(d) for d in self.meta.get("shape") or ())
        self.dtype = self.meta.get("dtype")
        self.param_group = self.meta.get("group")
        if self.param_group is not None:
            self.param_group = int(self.param_group)
        if listed is None:
            self._group = group
            self.records, self._storage = self._load(group)
            self._num_rows = len(self.records)
        else:
            self._open_group, self._num_rows = group, listed.rows

    def _load(self, group: h5py.Group) -> tuple[np.ndarray, validate.ParamDatasets]:
        """(committed record of each row, {kind: storage dtype}) from the parameter's group."""
        check, where = self._check, self._where
        with check.reading(where):
            links = validate.link_types(group)  # one pass over the group's links serves every lookup below
        # Rows whose record was never committed (a crash mid-record) do not exist for readers.
        records = validate.record_index(check, group, where, links, committed=self.optimizer.num_records)
        # {kind: storage dtype}, its datasets checked at the first read (validate.ParamDatasets: opening stays cheap)
        storage = validate.ParamDatasets(check, group, where, self.shape, len(records), links,
                                         None if self._listed is None else self._listed.kinds)
        return records, storage

    def _open_listed(self) -> None:
        """Open a parameter listed by the parameter index, and check its group against the listing: what was shown
        from the index is what its data is read as, or the file is refused."""
        failed = self.__dict__.get("_open_failed")
        if failed is not None:  # opened once, refused once: every later read gets the same refusal, no reopening
            raise failed
        try:
            group = self._open_group()
            listed = self._listed
            meta = validate.param_meta(self._check, group, self._where)
            records, storage = self._load(group)
            problem = ("its metadata differs from the index's" if meta != listed.meta else
                       param_index.disagreement(listed, len(records), list(storage), storage.state_keys))
            if problem:
                raise self._check.fail(self._where, f"{problem} (the parameter index of optimizer "
                                                    f"{self.optimizer.index} does not describe this file)")
        except RunFileError as exc:
            self.__dict__["_open_failed"] = exc
            raise
        self.__dict__.update(_group=group, records=records, _storage=storage)

    # A parameter listed by the parameter index opens its group at the first of these (see _open_listed); one read
    # from its group has them from the start.
    @cached_property
    def _group(self) -> h5py.Group:
        self._open_listed()
        return self.__dict__["_group"]

    @cached_property
    def records(self) -> np.ndarray:
        """The committed record (row of the optimizer's record table) each row belongs to."""
        self._open_listed()
        return self.__dict__["records"]

    @cached_property
    def _storage(self) -> validate.ParamDatasets:
        self._open_listed()
        return self.__dict__["_storage"]

    @property
    def num_rows(self) -> int:
        """Rows stored (one per committed record that holds this parameter); index them with ``read``."""
        return self._num_rows

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def kinds(self) -> list[str]:
        found = self._storage if self._listed is None else self._listed.kinds
        return [k for k in schema.TENSOR_KINDS if k in found]

    @cached_property
    def state_keys(self) -> list[str]:
        return list(self._storage.state_keys if self._listed is None else self._listed.state_keys)

    def _reading(self, what: str) -> Reading:
        return Reading(self.optimizer.run.path,
                        f"{what} of parameter {self.name!r} (optimizer {self.optimizer.index})",
                        getattr(self.optimizer.run, "_raw", None))

    def _decode(self, ds: h5py.Dataset, rows, torch_dtype: str | None) -> torch.Tensor:
        return encoding.numpy_to_tensor(ds[rows], torch_dtype or "float32")

    def _has(self, kind: str) -> bool:
        if kind in self._storage:
            return True
        with self._reading(repr(kind)):
            return link_type(self._group, kind) is not None  # the link itself: never follows it

    def _checked(self, kind: str) -> str | None:
        """The storage dtype of a dataset outside the three kinds (e.g. 'state/exp_avg'), checked like them."""
        return validate.tensor_dataset(self.optimizer.run._validator(), self._group, kind,
                                       f"parameter {self.name!r} of optimizer {self.optimizer.index}: dataset {kind!r}")

    def read(self, kind: str, rows=slice(None)) -> torch.Tensor:
        """Tensor of kind ('param', 'grad', 'param_after', or 'state/<key>') at the given row(s); rows index
        ``self.records``. The optimizer state of a row as a dict: ``state_at(row)``."""
        state_prefix = schema.STATE_GROUP + "/"
        if kind not in schema.TENSOR_KINDS and not (kind.startswith(state_prefix) and len(kind) > len(state_prefix)):
            # the caller's mistake, not the file's: say what read() takes
            raise ValueError(f"{self.name}: read() takes one of {', '.join(map(repr, schema.TENSOR_KINDS))} or "
                             f"'{state_prefix}<key>' (keys here: {', '.join(self.state_keys) or 'none'}), not "
                             f"{kind!r}" + ("; the whole state at a row: state_at(row)"
                                            if kind == schema.STATE_GROUP else ""))
        if not self._has(kind):
            raise KeyError(f"{self.name}: no {kind!r} recorded")
        rows = self._clip(rows)
        torch_dtype = self._storage[kind] if kind in self._storage else self._checked(kind)
        with self._reading(f"{kind!r} rows {_rows_text(rows)}"):
            return self._decode(self._group[kind], rows, torch_dtype)

    def _clip(self, rows):
        return clip_rows(rows, self.num_rows, self.name)

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
                    out[key] = self._decode(ds, row, self._storage.state_dtypes.get(key))
        return out

    def read_part(self, kind: str, rows: slice, elements: tuple = ()) -> torch.Tensor:
        """Rows of `kind` (a tensor kind, or 'state/<key>'), restricted to `elements` (an index over the stored
        tensor's own dimensions), in the stored dtype: how verify streams a parameter of any size in bounded
        blocks. The dataset handle is kept, so many small reads pay no name lookup."""
        ds, dtype = self._handle(kind)
        rows = slice(rows.start, min(rows.stop, ds.shape[0]))  # a state dataset may hold fewer rows: fewer come back
        with self._reading(f"{kind!r} rows {_rows_text(rows)}"):
            array = ds[(rows, *elements)]
        import torch  # here, not at the top: listing a run (`upd info`) needs no torch

        tensor = torch.from_numpy(np.ascontiguousarray(array.view(np.uint16) if dtype == "bfloat16" else array))
        return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor

    def _handle(self, kind: str):
        """(dataset, stored torch dtype) of `kind`, looked up once."""
        handles = self.optimizer.run._handles_of(self)
        if kind not in handles:
            state_key = kind[len(schema.STATE_GROUP) + 1:] if kind.startswith(schema.STATE_GROUP + "/") else None
            dtype = (self._storage.state_dtypes.get(state_key) if state_key is not None else
                     self._storage[kind] if kind in self._storage else self._checked(kind))
            with self._reading(repr(kind)):
                # a tensor kind was checked (a hard link to a dataset of its declared dtype) by _storage just above:
                # opened without h5py's group[name], a third of the cost of reading a small parameter's rows
                ds = self._check.open_checked(self._group, kind) if kind in schema.TENSOR_KINDS else self._group[kind]
                handles[kind] = (ds, dtype or "float32")
        return handles[kind]

    def stored_shape(self, kind: str) -> tuple:
        """The shape of one row of `kind` (as read_part takes it), e.g. ``()`` for a scalar state entry."""
        return tuple(self._handle(kind)[0].shape[1:])

    def state_present(self, rows: slice) -> np.ndarray:
        """(rows, state keys) bool: which state keys were stored at each of `rows` (rows past the mask: False)."""
        out = np.zeros((rows.stop - rows.start, len(self.state_keys)), bool)
        if self.state_keys:
            handles = self.optimizer.run._handles_of(self)
            with self._reading(f"state presence rows {_rows_text(rows)}"):
                ds = handles.get(schema.STATE_PRESENT) or handles.setdefault(schema.STATE_PRESENT,
                                                                             self._group[schema.STATE_PRESENT])
                got = ds[rows.start:min(rows.stop, ds.shape[0]), :out.shape[1]].astype(bool)
            out[:got.shape[0], :got.shape[1]] = got
        return out

    def state_shape(self, key: str) -> tuple | None:
        """The shape state `key` was stored with at each row (``()`` for a scalar such as Adam's ``step``, which
        ``state_at`` returns with shape (1,)); None when it was never stored."""
        with self._reading(f"the shape of state {key!r}"):
            state = self._group[schema.STATE_GROUP]
            return tuple(state[key].shape[1:]) if key in self.state_keys and key in state else None

    def storage_dtype(self, kind: str = schema.KIND_PARAM) -> str | None:
        if self._listed is not None and kind in schema.TENSOR_KINDS:  # as listed: checked when the data is read
            return self._listed.kinds.get(kind)
        if kind in self._storage:
            return self._storage.dtype_of(kind)
        return self._checked(kind) if self._has(kind) else None

    def __repr__(self) -> str:
        return f"<ParamRecord {self.name} {list(self.shape)} {self.num_rows} rows>"


def clip_rows(rows, num_rows: int, name: str):
    """Rows as ``ParamRecord.read`` takes them (an int, a slice, a boolean mask or an increasing sequence of ints)
    checked against `num_rows`: an int, a slice or an index array. IndexError names the parameter."""
    if isinstance(rows, slice):
        start, stop, step = rows.indices(num_rows)
        return slice(start, stop, step)
    if isinstance(rows, (int, np.integer)):
        if not -num_rows <= rows < num_rows:
            raise IndexError(f"{name}: row {rows} out of range ({num_rows} rows)")
        return int(rows) % num_rows
    index = np.asarray(rows)
    if index.dtype.kind == "b":
        if index.shape != (num_rows,):
            raise IndexError(f"{name}: boolean row mask of shape {index.shape}, expected ({num_rows},)")
        index = np.nonzero(index)[0]
    if index.ndim != 1 or (len(index) and index.dtype.kind not in "iu"):
        raise IndexError(f"{name}: rows must be an int, a slice or a 1-D sequence of ints")
    if len(index) and (index.min() < 0 or index.max() >= num_rows):
        raise IndexError(f"{name}: rows out of range ({num_rows} rows)")
    if (np.diff(index) <= 0).any():
        raise IndexError(f"{name}: a sequence of rows must be increasing")
    return index.astype(np.intp)


def _rows_text(rows) -> str:
    if isinstance(rows, slice):
        return f"{rows.start}:{rows.stop}" + (f":{rows.step}" if rows.step != 1 else "")
    if isinstance(rows, int):
        return str(rows)
    return f"({len(rows)} rows)"


class OptimizerRun:
    """One recorded optimizer: its committed records and its parameters."""

    def __init__(self, run: "Run", index: int, group: h5py.Group, check: Validator | None = None):
        self.run = run
        self.index = index
        self._group = group
        check = check or run._validator()
        where = f"optimizer {index}"
        self.meta = validate.optimizer_meta(check, group, where)
        table = validate.record_table(check, group, where)
        self.num_records = table.num_records
        self.steps = table.steps
        self.backward_passes = table.backward_passes
        self.wall_times = table.wall_times
        self.learning_rates = table.learning_rates
        self._hparams_ds = table.datasets[schema.HPARAMS]
        self._closure_ds = table.datasets[schema.CLOSURE_LOSSES]
        self.class_name = self.meta.get("class", "?")
        at = f"{where}: group '{schema.PARAMS}'"
        params = check.child(group, schema.PARAMS, at, h5py.Group)
        names = check.members(params, at)
        with check.reading(at):
            links = validate.link_types(params)
        listing = self._param_index(check, params, names, at)
        if listing is None:  # every parameter read from its group
            records = [ParamRecord(self, schema.param_name(key),  # the name as recorded ('/' is escaped in the file)
                                   check.child(params, key, f"{where}: parameter {key!r}", h5py.Group, links=links),
                                   check) for key in names]
        else:  # listed from the index; a parameter's group is opened (and checked) when its data is first read
            records = []
            for key in names:
                at_key = f"{where}: parameter {key!r}"
                check.hard_link(links.get(key.encode("utf-8")), at_key)
                records.append(ParamRecord(self, schema.param_name(key),
                                           functools.partial(check.child, params, key, at_key, h5py.Group,
                                                             links=links), check, listed=listing[key]))
        validate.param_groups(check, records, self.learning_rates.shape[1], where)
        # HDF5 lists names alphabetically (layers.10 before layers.3); show them in the optimizer's order.
        records.sort(key=lambda p: (p.param_group or 0, p.meta.get("index_in_group") or 0))
        self.param_records: dict[str, ParamRecord] = {p.name: p for p in records}
        # the per-step statistics table (stats_table reads its values): what its rows say of their steps
        self.stats_table_steps = validate.stats_table(check, group, where)

    def _param_index(self, check: Validator, params: h5py.Group, names: list, where: str) -> dict | None:
        """{group name: its entry} from the parameter index (param_index.py), or None when there is none or it
        cannot be used as a whole: the parameters are then read from their groups (``param_index_problem`` says
        why)."""
        try:
            value = check.json_attr(params, schema.PARAM_INDEX, where, required=False)
        except RunFileError as exc:  # unreadable text, a string longer than any run holds: ignored
            self.param_index_problem = str(exc)
            return None
        if value is None:
            self.param_index_problem = "no parameter index"
            return None
        found = param_index.parse(value, self.num_records, set(names), validate.meta_problem)
        self.param_index_problem = found if isinstance(found, str) else None
        return None if isinstance(found, str) else found

    def _reading(self, what: str) -> Reading:
        return Reading(self.run.path, f"{what} of optimizer {self.index}", getattr(self.run, "_raw", None))

    def hparams(self, record: int) -> list[dict]:
        """The param groups' hyperparameters at one record, as the optimizer saw them (JSON-decoded)."""
        if not 0 <= record < self.num_records:
            raise IndexError(f"record {record} out of range ({self.num_records} records)")
        self.run._validator().vlen_rows(self._hparams_ds, range(record, record + 1),
                                        f"optimizer {self.index}: {_HPARAMS}[{record}]")
        with self._reading(f"{_HPARAMS}[{record}]"):
            value = json_value(self._hparams_ds[record])
        if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
            raise RunFileError(f"{self.run.path}: optimizer {self.index}: {_HPARAMS}[{record}] is not a JSON list "
                               f"of param-group objects")
        return value

    def closure_losses(self, record: int) -> list | None:
        """Losses of each closure evaluation inside the step (LBFGS & co.), or None for a step without closure."""
        ds = self._closure_ds
        if ds is None or not 0 <= record < ds.shape[0]:
            return None
        self.run._validator().vlen_rows(ds, range(record, record + 1),
                                        f"optimizer {self.index}: {_CLOSURE_LOSSES}[{record}]")
        with self._reading(f"{_CLOSURE_LOSSES}[{record}]"):
            value = json_value(ds[record])
        if value is not None and not isinstance(value, list):
            raise RunFileError(f"{self.run.path}: optimizer {self.index}: {_CLOSURE_LOSSES}[{record}] is not a "
                               f"JSON list or null")
        return value

    def scalars(self) -> pd.DataFrame:
        """The scalars logged at this optimizer's steps (``rec.log``, closure losses, total gradient norms): columns
        step, wall_time and one per name, one row per step that logged something."""
        return scalars_frame(self.run._validator(), self._group, f"optimizer {self.index}")

    def committed_stats_steps(self) -> np.ndarray:
        """The optimizer step of each committed row of the statistics table (empty without one)."""
        return self.stats_table_steps.steps

    def stats_state_keys(self) -> list[str]:
        """The optimizer state keys the statistics table holds statistics of."""
        with self._reading("the statistics table"):
            return stats_state_keys(self)

    @property
    def num_param_groups(self) -> int:
        """Param groups the records or the statistics rows saw (the most at any step)."""
        return max(self.learning_rates.shape[1] if self.learning_rates.ndim == 2 else 0,
                   self.stats_table_steps.learning_rates.shape[1])

    def step_hparams(self, step: int) -> list[dict] | None:
        """The param groups' hyperparameters at an optimizer step, from its record, else its statistics row (lr as
        scheduled at that step); None for a step with neither."""
        at = np.nonzero(self.steps == step)[0]
        if len(at):
            return self.hparams(int(at[-1]))
        rows = np.nonzero(self.stats_table_steps.steps == step)[0]
        if not len(rows):
            return None
        return self.stats_hparams(int(rows[-1]))

    def stats_hparams(self, row: int) -> list[dict] | None:
        """The param groups' hyperparameters at a statistics row; None when the file does not say."""
        ds, n = self.stats_table_steps.hparams, len(self.stats_table_steps.steps)
        if not 0 <= row < n:
            raise IndexError(f"statistics row {row} out of range ({n} rows)")
        where = f"optimizer {self.index}: {schema.STATS}/{schema.HPARAMS}[:{row + 1}]"
        self.run._validator().vlen_rows(ds, range(row + 1), where)  # a row stores its changes: read up to it
        with self._reading(f"{schema.STATS}/{schema.HPARAMS}"):
            texts = list(ds[:row + 1])
        return hparams_rows(texts, self.stats_table_steps.learning_rates[:row + 1])[row]

    def __repr__(self) -> str:
        return (f"<OptimizerRun {self.index} {self.class_name}: {len(self.param_records)} params, "
                f"{self.num_records} records>")


class RunReader:
    """What a single run file (Run) and a distributed job (Job) offer alike, from their ``meta`` and
    ``optimizers``: parameter lookup, the recording options, and use as a context manager."""

    @property
    def torch_version(self) -> str:
        return self.meta.get("torch_version", "?")

    @property
    def options(self) -> dict:
        return self.meta.get("options", {})

    def param(self, name: str, optimizer: int | None = None):
        for opt in self.optimizers:
            if (optimizer is None or opt.index == optimizer) and name in opt.param_records:
                return opt.param_records[name]
        names = [n for opt in self.optimizers if optimizer is None or opt.index == optimizer
                 for n in opt.param_records]
        close = difflib.get_close_matches(name, names, n=3)
        listed = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        raise KeyError(f"{self.path}: no parameter {name!r}"
                       + (f"{'' if optimizer is None else f' in optimizer {optimizer}'}; did you mean "
                          f"{' or '.join(map(repr, close))}?" if close else "")
                       + (f" Recorded parameters: {listed}" if names else " (no parameter has full records)"))

    def iter_params(self) -> Iterator:
        for opt in self.optimizers:
            yield from opt.param_records.values()

    def scalars(self) -> pd.DataFrame:
        """The logged scalars (``rec.log``, the loss of ``step(closure)`` steps, the total gradient norms, a
        Trainer's logs): one row per (optimizer, step) that logged something; columns optimizer, step, wall_time
        and one per name (NaN where a step did not log that name)."""
        return scalars_table(self.optimizers)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Run(RunReader):
    """A recorded run. ``upd.open_run(path)`` opens one; use it as a context manager or call ``close()``."""

    def __init__(self, path, live_timeout: float | None = None):
        self.path = os.fspath(path)
        check_path(self.path)
        self.live = False  # True: a writer had the file open, and this reads a copy taken between two records
        try:
            fd = validate.open_regular(self.path)  # opened first, then checked: a FIFO swapped in cannot block
            if livelock.writer_present(fd):
                self.live, live_fd = True, fd
                try:
                    fd = livelock.snapshot(live_fd, timeout=_live_timeout(live_timeout))
                except (OSError, TimeoutError, RuntimeError) as exc:
                    raise RunFileError(f"{self.path}: being written, and no complete copy of it could be taken "
                                       f"({phrase(exc)})") from None
                finally:
                    os.close(live_fd)
            try:
                self._raw = GuardedFile(self.path, fd, snapshot=self.live)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            raise RunFileError(f"{self.path}: cannot open ({phrase(exc)})") from None
        try:
            self._file = h5py.File(self._raw, "r")
        except Exception as exc:  # h5py raises OSError for most non-HDF5 input, other types for some garbage
            self._raw.close()
            raise RunFileError(f"{self.path}: not a readable HDF5 file ({phrase(exc)})") from None
        lifetime.runs.add(self)  # closed at exit while Python still runs (see upd/lifetime.py)
        try:
            _bound_metadata_cache(self._file)
            self._load()
        except RunFileError:
            self.close()
            raise
        except Exception as exc:  # a file that h5py opens can still be broken anywhere inside
            self.close()
            raise RunFileError(f"{self.path}: unreadable run ({phrase(exc)})") from None

    def _load(self) -> None:
        check = self._validator()
        self.format_version = validate.format_version(check, self._file)
        self.meta = validate.run_meta(check, self._file)
        groups, names = validate.optimizer_names(check, self._file)
        self.optimizers = [OptimizerRun(self, int(k), check.child(groups, k, f"optimizer {k}", h5py.Group), check)
                           for k in names]
        self.params_not_optimized = validate.params_not_optimized(check, self._file)
        # True once the recorder closed the file; False for a run still being written, or cut short by a crash.
        self.closed_cleanly = check.json_attr(self._file, schema.ATTR_CLOSED_CLEANLY, "root", default=False,
                                              required=False) is True
        resumes = check.json_attr(self._file, schema.ATTR_RESUMES, "root", list, default=[], required=False)
        # One entry per resume=True session. Informational: a field that is not what the writer puts there is
        # unknown (None), never a reason to refuse a run that is otherwise whole.
        self.resumes = [{**r, "created_unix": r.get("created_unix") if validate.is_unix_time(r.get("created_unix"))
                         else None} for r in resumes if isinstance(r, dict)]

    def _reading(self, what: str) -> Reading:
        return Reading(self.path, what, getattr(self, "_raw", None))

    def _handles_of(self, param: ParamRecord) -> dict:
        """{kind: (dataset, stored dtype)} kept open for `param` (ParamRecord.read_part: many small reads of one
        parameter pay no lookup), for the last KEPT_OPEN_PARAMS parameters read only: a pass over every parameter
        then holds a few datasets open, not all of them."""
        kept = self.__dict__.setdefault("_kept_handles", {})  # id(param) -> its handles, least recently used first
        handles = kept.pop(id(param), None)
        kept[id(param)] = {} if handles is None else handles
        while len(kept) > KEPT_OPEN_PARAMS:
            kept.pop(next(iter(kept)))
        return kept[id(param)]

    def _validator(self) -> Validator:
        return Validator(self.path, self.size_bytes, getattr(self, "_raw", None))

    # -- overview ---------------------------------------------------------------------------------------------
    # -- tables: every DataFrame is a method call (it reads the file) --------------------------------------------
    def params(self) -> pd.DataFrame:
        """One row per recorded parameter, full records or statistics rows or both, in model order (optimizer, param,
        shape, numel, dtype, group, rows, stats_rows, kinds, state)."""
        rows = []
        for opt in self.optimizers:
            with self._reading(f"the statistics table of optimizer {opt.index}"):
                stats_meta = stats_param_meta(opt)
            rows += [params_row(opt, p) for p in param_entries(opt, stats_meta)]
        return pd.DataFrame(rows, columns=PARAMS_COLUMNS)

    def steps(self) -> pd.DataFrame:
        """One row per committed record (optimizer, record, step, backward_pass, wall_time, lr per param group) and
        per step that logged scalars without a record, with one column per logged scalar (``rec.log``); see
        ``steps_table``."""
        return steps_table(self.optimizers)

    def dumps(self) -> pd.DataFrame:
        """The flight-recorder dumps, one row each (optimizer, reason, trigger_step, steps, wall_time)."""
        return pd.DataFrame(self._dump_entries(), columns=DUMP_COLUMNS)

    def events(self) -> pd.DataFrame:
        """The live alerts recorded (``upd.record(..., alerts=...)``), one row each, in the order raised: optimizer,
        step, kind (an ``upd.alert_rules`` kind), param, value (the number that made it fire), wall_time. Each is
        an alert that did not fire at the optimizer's previous statistics step (docs/diagnosis.md)."""
        return pd.DataFrame(self._event_entries(), columns=EVENT_COLUMNS)

    @property
    def size_bytes(self) -> int:
        """Bytes read: the file's size, or the copy's for a run being written."""
        raw = getattr(self, "_raw", None)
        return raw.size if raw is not None else os.path.getsize(self.path)

    def describe(self) -> dict:
        """What the file holds, as plain data (what `upd info` prints)."""
        optimizers = []
        for opt in self.optimizers:
            with self._reading(f"the statistics table of optimizer {opt.index}"):
                stats_steps, stats_meta = committed_stats_rows(opt), stats_param_meta(opt)
            optimizers.append(describe_optimizer(opt, stats_steps, stats_meta))
        desc = {"path": self.path, "live": self.live, "size_bytes": self.size_bytes,
                "format_version": self.format_version, "torch_version": self.torch_version,
                "upd_version": self.meta.get("upd_version"), "created_unix": self.meta.get("created_unix"),
                "options": self.options, "params_not_optimized": self.params_not_optimized, "optimizers": optimizers,
                "closed_cleanly": self.closed_cleanly, "resumes": self.resumes}
        if isinstance(self.meta.get(schema.META_DISTRIBUTED), dict):  # one rank's file of a distributed job
            desc[schema.META_DISTRIBUTED] = self.meta[schema.META_DISTRIBUTED]
        return desc

    # -- analysis ---------------------------------------------------------------------------------------------
    def ratios(self, block_bytes: int = DEFAULT_BLOCK_BYTES, source: str = "auto") -> pd.DataFrame:
        """Tidy DataFrame, one row per (optimizer, param, step): update:data and grad:data ratios and norms.

        update_to_data = log10(std(param_after - param) / std(param)) and grad_to_data = log10(std(grad) /
        std(param)), std as torch.std (unbiased), exactly as the seed question's loop.

        source: "tensors" computes them from the full tensors (streamed in bounded blocks: a large run is never
        loaded whole); "stats" reads the per-step statistics table; "auto" (default) uses, per optimizer, whichever
        covers more steps (statistics every step beat full tensors every 500th). From the tensors, torch runs on
        one thread (torch.set_num_threads, restored when done): the sums are taken in chunks too small for its
        thread pool to pay off.
        """
        with self._reading("the statistics table"):
            stats_rows = {opt.index: committed_stats_rows(opt) for opt in self.optimizers}

        def stats_table() -> pd.DataFrame:
            with self._reading("the statistics table"):
                return stats_frame(self)
        return ratios_table(self, block_bytes, source, stats_rows, stats_table)

    def _dump_entries(self) -> list[dict]:
        check = self._validator()
        where = f"dataset '{schema.FLIGHT_DUMPS}'"
        ds = check.declared(self._file, schema.ROOT.dataset(schema.FLIGHT_DUMPS), where)
        if ds is None:
            return []
        check.readable(ds, ds.shape[0], where)
        check.vlen_rows(ds, range(ds.shape[0]), where)
        with self._reading(where):
            dumps = [json_value(x) for x in ds[()]]
        if not all(isinstance(d, dict) for d in dumps):
            raise RunFileError(f"{self.path}: {schema.FLIGHT_DUMPS} is malformed (not a list of JSON objects)")
        return dumps

    def _event_entries(self) -> list[dict]:
        check = self._validator()
        where = f"dataset '{schema.EVENTS}'"
        ds = check.declared(self._file, schema.ROOT.dataset(schema.EVENTS), where)
        if ds is None:
            return []
        rows = ds.shape[0]
        if rows > schema.MAX_EVENT_ROWS:
            raise RunFileError(f"{self.path}: {where} has {rows} entries (the limit is {schema.MAX_EVENT_ROWS})")
        check.readable(ds, rows, where)
        check.vlen_rows(ds, range(rows), where, limit=schema.MAX_EVENT_BYTES)
        with self._reading(where):
            entries = [json_value(x) for x in ds[()]]
        return [event_entry(entry, f"{self.path}: {where}, entry {i}") for i, entry in enumerate(entries)]

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
        lifetime.runs.discard(self)

    def __repr__(self) -> str:
        return f"<upd.Run {self.path!r}: " + ", ".join(repr(o) for o in self.optimizers) + ">"


def scalars_table(optimizers) -> pd.DataFrame:
    """``scalars()``: every optimizer's logged scalars, with an optimizer column first."""
    frames = []
    for opt in optimizers:
        frame = opt.scalars()
        if len(frame):
            frame.insert(0, "optimizer", opt.index)
            frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["optimizer", *SCALAR_KEY_COLUMNS])
    return pd.concat(frames, ignore_index=True)


def steps_table(optimizers) -> pd.DataFrame:
    """``steps()``: one row per step of each optimizer (a Run's, or a Job's aligned ones) that has a committed
    record, a statistics row (``step_table.step_frame``), or logged scalars; one column per logged scalar.
    ``record`` and ``stats_row`` are the step's rows in the two tables, <NA> where it has none (then of pandas'
    nullable Int64 dtype); a step with logged scalars only has <NA> ``backward_pass`` and NaN learning rates."""
    frames = []
    for opt in optimizers:
        stats = opt.stats_table_steps
        df = step_frame(opt.index, (opt.steps, opt.backward_passes, opt.wall_times, opt.learning_rates),
                        (stats.steps, stats.backward_passes, stats.wall_times, stats.learning_rates))
        scalars = opt.scalars()
        if len(scalars):
            df = _with_scalars(df, scalars, opt.index)
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["optimizer", "record", "stats_row", "step", "backward_pass", "wall_time"])


def _with_scalars(records: pd.DataFrame, scalars: pd.DataFrame, index: int) -> pd.DataFrame:
    """The record rows of one optimizer joined with its scalars on the step: a step with scalars and no record
    gets a row of its own (wall time from the scalars table)."""
    merged = records.merge(scalars.rename(columns={"wall_time": "_scalar_wall_time"}), on="step", how="outer",
                           sort=True)
    merged["optimizer"] = index
    merged["wall_time"] = merged["wall_time"].fillna(merged.pop("_scalar_wall_time"))
    for column in ("record", "stats_row", "backward_pass"):
        if merged[column].isna().any():
            merged[column] = merged[column].astype("Int64")
        else:
            merged[column] = merged[column].astype(np.int64)
    return merged.reset_index(drop=True)


PARAMS_COLUMNS = ["optimizer", "param", "shape", "numel", "dtype", "group", "rows", "stats_rows", "kinds", "state"]


def param_entries(opt, stats_meta: dict) -> list[dict]:
    """Every parameter of one optimizer (a Run's, or a Job's), with full records or statistics rows or both, in
    model order: name, shape, dtype, group, index_in_group, rows (full-record rows), stats_rows, kinds, state (the
    state keys its full records hold, else those its statistics have), stored_as. stats_meta: the parameters of
    its statistics table."""
    stats_rows = len(opt.stats_table_steps.steps)
    stats_state = opt.stats_state_keys() if stats_meta else []
    with encoding.gc_paused():
        return model_order(_entries(opt, stats_meta, stats_rows, stats_state))


def _entries(opt, stats_meta: dict, stats_rows: int, stats_state: list) -> list[dict]:
    entries = [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "group": p.param_group,
                "index_in_group": p.meta.get("index_in_group"), "rows": p.num_rows,
                "stats_rows": stats_rows if p.name in stats_meta else 0, "kinds": p.kinds,
                "state": p.state_keys or (stats_state if p.name in stats_meta else []),
                "stored_as": p.storage_dtype()} for p in opt.param_records.values()]
    entries += [{"name": name, "shape": list(meta.get("shape") or []), "dtype": meta.get("dtype"),
                 "group": meta.get("group"), "index_in_group": meta.get("index_in_group"), "rows": 0,
                 "stats_rows": stats_rows, "kinds": [], "state": list(stats_state), "stored_as": None}
                for name, meta in stats_meta.items() if name not in opt.param_records]
    return entries


def params_row(opt, entry: dict) -> dict:
    """A row of ``params()`` from a ``param_entries`` entry."""
    shape = tuple(entry["shape"])
    return {"optimizer": opt.index, "param": entry["name"], "shape": shape,
            "numel": int(np.prod(shape)) if shape else 1, "dtype": entry["dtype"], "group": entry["group"],
            "rows": entry["rows"], "stats_rows": entry["stats_rows"], "kinds": ",".join(entry["kinds"]),
            "state": ",".join(entry["state"])}


def describe_optimizer(opt, stats_steps: int, stats_meta: dict) -> dict:
    """One optimizer's entry of ``describe()`` (a Run's, or a Job's): its records, groups and parameters;
    stats_meta: the parameters of its statistics table, listed too when they have no full records."""
    steps = opt.steps
    every = np.union1d(steps, opt.stats_table_steps.steps)  # the steps with a record or a statistics row
    return {
        "index": opt.index, "class": opt.class_name, "records": opt.num_records,
        "stats_steps": stats_steps,
        "first_step": int(steps[0]) if len(steps) else None,
        "last_step": int(steps[-1]) if len(steps) else None,
        "first_recorded_step": int(every[0]) if len(every) else None,
        "last_recorded_step": int(every[-1]) if len(every) else None,
        "param_groups": opt.num_param_groups,
        "defaults": opt.meta.get("defaults", {}),
        "frozen": frozen_params(opt),
        "params": _without_position(param_entries(opt, stats_meta)),
    }


def _without_position(entries: list[dict]) -> list[dict]:
    """The entries without their "index_in_group" (model_order has used it), in place: a copy of each entry cost
    more than the entry itself for 1.1M statistics-only names."""
    for entry in entries:
        entry.pop("index_in_group", None)
    return entries


def frozen_params(opt) -> list[str]:
    """Names of the parameters the optimizer held with requires_grad=False when recording started: they get no
    gradient, so no rows, and are listed as frozen instead of vanishing."""
    params = opt.meta.get("params")
    if not isinstance(params, list):
        return []
    return [str(p.get("name")) for p in params if isinstance(p, dict) and p.get("requires_grad") is False]


def _bound_metadata_cache(file: h5py.File) -> None:
    """Cap HDF5's metadata cache at METADATA_CACHE_BYTES. The reader visits each object's metadata about once, so
    the cache's hit rate stays low and HDF5's adaptive sizing grows it to its 32 MiB default maximum, per open file:
    memory that buys no speed on a pass that reads everything once."""
    config = file.id.get_mdc_config()
    config.max_size = max(config.min_size, min(config.max_size, METADATA_CACHE_BYTES))
    file.id.set_mdc_config(config)


def _live_timeout(given: float | None) -> float:
    if given is not None:
        return float(given)
    try:
        return float(os.environ.get("UPD_LIVE_TIMEOUT", "30"))
    except ValueError:
        return 30.0
