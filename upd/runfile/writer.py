"""HDF5 writing for the recorder: one file per run, datasets created lazily, every record committed with a flush.

What is created where, with which dtype and chunks, is declared in schema.py; this module fills it.

Commit protocol (docs/format.md, "Crash safety and commit protocol"): all rows of a record are written and flushed
first; only then is the record's entry appended to the optimizer's ``records/step`` dataset and the file flushed
again. Readers trust ``len(records/step)`` and nothing beyond it. Measured under SIGKILL with HDF5's default file
format: a flush after every step left a file plain h5py opens with every committed step (26/26 kills), while a
step marker flushed together with its rows could become durable before them; hence two flushes, marker last.

Live reading: every change to the file happens between ``self._locks.begin()`` and the ``end()`` that follows its
flush (``livelock.py``), so a reader that copies the file outside those spans copies a complete run.
"""
from __future__ import annotations

import errno
import os
import shutil

import h5py
import numpy as np
import torch

from . import encoding, schema
from .guards import SUPERBLOCK_BYTES, parse_superblock
from .livelock import WriterLocks
from .record import ParamSnapshot, Record, param_meta

try:
    import resource  # POSIX: the file-size limit counts as space
except ImportError:  # pragma: no cover - Windows
    resource = None


def _h5py_dtype(decl: schema.Dataset):
    return h5py.string_dtype() if decl.dtype == schema.STRING else np.dtype(decl.dtype)


def _create(group: h5py.Group, decl: schema.Dataset, **layout) -> h5py.Dataset:
    """An empty dataset as the schema declares it, resizable along every axis; layout: the shape and chunks of a
    dataset the writer sizes itself when it creates it."""
    rank = decl.rank
    return group.create_dataset(decl.name, shape=layout.get("shape", (0,) * rank), maxshape=(None,) * rank,
                                dtype=_h5py_dtype(decl), chunks=layout.get("chunks", decl.chunks),
                                fillvalue=decl.fill)


def _create_declared(group: h5py.Group, layout: schema.Group) -> None:
    """The datasets of a new group whose chunks the schema fixes; the others are created at their first row."""
    for decl in layout.datasets:
        if decl.chunks is not None:
            _create(group, decl)


def _truncate(group: h5py.Group, layout: schema.Group, rows: int) -> None:
    """Drop the rows at and beyond `rows` of every declared dataset of group (a state group: every key's)."""
    names = list(group) if layout is schema.STATE else [d.name for d in layout.datasets]
    for name in names:
        if name in group and group[name].shape[0] > rows:
            group[name].resize(rows, axis=0)


def _chunks(shape: tuple) -> tuple:
    # Record axis first with one record per chunk: a parameter's full history is one contiguous slice and a row
    # write touches exactly one chunk. HDF5 caps a chunk at 4 GiB; split the leading tensor dim if needed.
    limit = 2**31 // 8
    inner = list(shape)
    while inner and int(np.prod(inner)) > limit:
        inner[0] = max(1, inner[0] // 2)
    return (1, *(max(1, d) for d in inner))  # HDF5 chunks are never empty: a rank's empty shard has a 0 dimension


class RunWriter:
    def __init__(self, path: str, meta: dict, *, overwrite: bool, storage_dtype: str, compression,
                 resume: bool = False):
        self.path = os.fspath(path)
        self.storage_dtype = storage_dtype
        self.compression = compression
        self._records_written: dict[int, int] = {}
        self._stats_layout: dict[int, dict] = {}
        if resume and os.path.exists(self.path):
            self._reopen(meta)
            return
        mode = "w" if overwrite else "w-"
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)  # upd.record("runs/exp1.h5", ...) creates runs/
        try:
            self.file = h5py.File(self.path, mode)
        except FileExistsError:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it") from None
        self._lock_file()
        self.file.attrs[schema.ATTR_FORMAT] = schema.FORMAT_NAME
        self.file.attrs[schema.ATTR_VERSION] = schema.FORMAT_VERSION
        self.file.attrs[schema.ATTR_META] = encoding.to_json(meta)
        self.file.create_group(schema.OPTIMIZERS)
        self._flushed()
        self._inode = os.stat(self.path).st_ino

    def _lock_file(self) -> None:
        try:
            self._locks = WriterLocks(self.path)
        except OSError:
            self.file.close()
            raise
        self._locks.begin()

    def _flushed(self) -> None:
        """Flush; the file is a complete run again, and live readers may copy it."""
        self.file.flush()
        self._locks.end()

    def _check_still_there(self) -> None:
        """A run file deleted or replaced under the writer would take every later record with it, silently."""
        try:
            same = os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            same = False
        if not same:
            raise OSError(errno.ENOENT, f"{self.path} was deleted or replaced while recording; nothing more is "
                                        "written to it")

    def _reopen(self, meta: dict) -> None:
        """Append to an existing run: drop rows of a record that was never committed (a crash mid-step)."""
        self.file = h5py.File(self.path, "r+")
        self._lock_file()
        self._inode = os.stat(self.path).st_ino
        if self.file.attrs.get(schema.ATTR_FORMAT) != schema.FORMAT_NAME or \
                self.file.attrs.get(schema.ATTR_VERSION) != schema.FORMAT_VERSION:
            self.file.close()
            self._locks.close()
            raise ValueError(f"{self.path}: cannot resume: not a torch-upd run of format version "
                             f"{schema.FORMAT_VERSION}")
        if schema.ATTR_CLOSED_CLEANLY in self.file.attrs:
            del self.file.attrs[schema.ATTR_CLOSED_CLEANLY]
        resumes = encoding.from_json(self.file.attrs.get(schema.ATTR_RESUMES, "[]"))
        resumes.append({k: meta.get(k) for k in ("created_unix", "argv", "torch_version", "upd_version")})
        self.file.attrs[schema.ATTR_RESUMES] = encoding.to_json(resumes)
        for key, opt in self.file[schema.OPTIMIZERS].items():
            records = opt[schema.RECORDS]
            committed = int(records[schema.COMMIT_COLUMN].shape[0])
            self._records_written[int(key)] = committed
            _truncate(records, schema.RECORD_TABLE, committed)
            for grp in opt[schema.PARAMS].values():
                valid = int((grp[schema.RECORD_INDEX][()] < committed).sum())
                _truncate(grp, schema.PARAMETER, valid)
                _truncate(grp[schema.STATE_GROUP], schema.STATE, valid)
            if schema.STATS in opt:
                stats = opt[schema.STATS]
                _truncate(stats, schema.STATS_TABLE, int(stats[schema.COMMIT_COLUMN].shape[0]))
        self._flushed()

    def _optimizer(self, index: int) -> h5py.Group | None:
        return self.file[schema.OPTIMIZERS].get(str(index))

    def optimizer_meta(self, index: int) -> dict | None:
        """The stored metadata of optimizer `index`, or None when the run has no such optimizer."""
        grp = self._optimizer(index)
        return None if grp is None else encoding.from_json(grp.attrs[schema.ATTR_META])

    def last_step(self, index: int) -> int | None:
        grp = self._optimizer(index)
        if grp is None:
            return None
        tables = [grp[schema.RECORDS]] + ([grp[schema.STATS]] if schema.STATS in grp else [])
        steps = [int(t[schema.COMMIT_COLUMN][-1]) for t in tables if t[schema.COMMIT_COLUMN].shape[0]]
        return max(steps) if steps else None

    # -- structure -------------------------------------------------------------------------------------------
    def add_optimizer(self, index: int, meta: dict) -> None:
        if self._optimizer(index) is not None:  # resuming: the optimizer's structure is there already
            return
        self._locks.begin()
        grp = self.file[schema.OPTIMIZERS].create_group(str(index))
        grp.attrs[schema.ATTR_META] = encoding.to_json(meta)
        _create_declared(grp.create_group(schema.RECORDS), schema.RECORD_TABLE)
        grp.create_group(schema.PARAMS)
        self._records_written[index] = 0
        self._flushed()

    def _param_group(self, optimizer: int, snap: ParamSnapshot) -> h5py.Group:
        params = self._optimizer(optimizer)[schema.PARAMS]
        if snap.name in params:
            return params[snap.name]
        grp = params.create_group(snap.name)
        reference = snap.param if snap.param is not None else snap.grad if snap.grad is not None else snap.param_after
        grp.attrs[schema.ATTR_META] = encoding.to_json(param_meta(snap, reference))
        _create_declared(grp, schema.PARAMETER)  # the record index and state_present; tensors at their first row
        st = grp.create_group(schema.STATE_GROUP)
        st.attrs[schema.STATE_KEYS] = encoding.to_json([])
        return grp

    def _tensor_dataset(self, grp: h5py.Group, name: str, tensor: torch.Tensor, rows: int,
                        storage: str | None = None) -> h5py.Dataset:
        if name in grp:
            return grp[name]
        np_dtype, stored_as = encoding.storage_numpy_dtype(tensor.dtype, storage or self.storage_dtype)
        shape = tuple(tensor.shape)
        # A 0 dimension (a rank's empty shard) must be resizable for its chunk of 1 to fit; it is never resized.
        ds = grp.create_dataset(name, shape=(rows, *shape), maxshape=(None, *(d or None for d in shape)),
                                dtype=np_dtype, chunks=_chunks(shape) if shape else (1024,),
                                compression=self.compression if shape else None)
        ds.attrs[schema.ATTR_TORCH_DTYPE] = stored_as
        ds.attrs[schema.ATTR_SOURCE_DTYPE] = encoding.dtype_name(tensor.dtype)
        return ds

    # -- writing ---------------------------------------------------------------------------------------------
    @staticmethod
    def _append(ds: h5py.Dataset, row: int, value) -> None:
        if ds.shape[0] <= row:
            ds.resize(row + 1, axis=0)
        ds[row] = value

    def _write_tensor(self, ds: h5py.Dataset, row: int, tensor: torch.Tensor) -> None:
        array = encoding.tensor_to_numpy(tensor, ds.attrs[schema.ATTR_TORCH_DTYPE])
        self._append(ds, row, array)

    def _check_space(self, rec: Record) -> int:
        """Refuse a record the disk (or the process's file-size limit) cannot take, before writing any of it; return
        the bytes it may need.

        HDF5 updates metadata in place: a write that fails half-way (ENOSPC, EFBIG) can leave metadata pointing past
        the end of the file, and the whole run unreadable. Stopping one record early keeps every committed step."""
        nbytes, datasets = 0, 4
        for snap in rec.params if rec.full else ():
            for t in (snap.param, snap.grad, snap.param_after, *snap.state.values()):
                if t is not None:
                    nbytes += t.numel() * t.element_size()
                    datasets += 1
        if rec.stats is not None:
            nbytes += 64 * len(rec.stats) * 4
        # Twice the data (chunk allocation, alignment) plus B-tree/heap growth per dataset touched, plus slack.
        need = 2 * nbytes + 4096 * datasets + (256 << 10)
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free
        if resource is not None:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY:  # never write past it: SIGXFSZ would kill the training process
                free = min(free, limit - max(os.path.getsize(self.path), self._end_of_allocation() or 0))
        if free < need:
            raise OSError(errno.ENOSPC, f"no room for the next record ({need / 1e6:.1f} MB needed, "
                                        f"{max(free, 0) / 1e6:.1f} MB left); the {self.path} written so far is kept")
        return need

    def _end_of_allocation(self, fd: int | None = None) -> int | None:
        """HDF5's end of allocated space as the last flush wrote it in the superblock (versions 0 and 1, the ones
        this writer creates); None for another layout."""
        found = parse_superblock(os.pread(self.file.id.get_vfd_handle() if fd is None else fd, SUPERBLOCK_BYTES, 0))
        return None if found is None else found.end_of_allocation

    def _reserve(self, nbytes: int) -> None:
        """Allocate disk blocks for the next `nbytes` HDF5 will allocate, so that a full disk fails here, before
        anything is written, and never in the middle of a flush (which can leave the file unreadable).

        The free-space estimate alone can be wrong (another process filling the disk, quotas, compression); the
        reservation cannot. Filesystems without fallocate fall back to the estimate."""
        end = self._end_of_allocation()
        if end is None:
            return
        try:
            os.posix_fallocate(self.file.id.get_vfd_handle(), end, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise OSError(exc.errno, f"no room for the next record ({nbytes / 1e6:.1f} MB could not be "
                                         f"reserved: {os.strerror(exc.errno)}); the {self.path} written so far is "
                                         "kept") from None
            # EOPNOTSUPP, EINVAL, ENODEV...: the filesystem cannot reserve; the estimate above stands alone

    def write(self, rec: Record) -> None:
        """Write one step (full tensors, statistics, or both) with the commit protocol."""
        self._check_still_there()
        need = self._check_space(rec)
        self._locks.begin()  # the reservation changes the file's length: a live reader must not be copying it
        self._reserve(need)
        if rec.full:
            self._write_full(rec)
        if rec.stats is not None:
            self._write_stats(rec)
        self.file.flush()
        self._reserve(256 << 10)  # the commit below grows a few B-trees: it must not be the write that fails
        # The commit: a record exists for readers once its step is appended, and only after its rows are durable.
        opt = self._optimizer(rec.optimizer)
        if rec.full:
            self._append(opt[schema.RECORDS][schema.COMMIT_COLUMN], self._records_written[rec.optimizer], rec.step)
            self._records_written[rec.optimizer] += 1
        if rec.stats is not None:
            commit = opt[schema.STATS][schema.COMMIT_COLUMN]
            self._append(commit, commit.shape[0], rec.step)
        self._flushed()

    def _stats_group(self, optimizer: int) -> h5py.Group:
        opt = self._optimizer(optimizer)
        if schema.STATS in opt:
            return opt[schema.STATS]
        st = opt.create_group(schema.STATS)
        _create_declared(st, schema.STATS_TABLE)  # values: at the first row, when its width is known
        st.attrs[schema.STATS_PARAMS] = encoding.to_json([])
        st.attrs[schema.STATS_COLUMNS] = encoding.to_json([])
        st.attrs[schema.STATS_PARAM_META] = encoding.to_json({})
        return st

    def _write_stats(self, rec: Record) -> None:
        st = self._stats_group(rec.optimizer)
        row = st[schema.COMMIT_COLUMN].shape[0]
        # The table's layout is kept in memory: decoding the JSON attributes at every step cost more than the row.
        layout = self._stats_layout.get(rec.optimizer)
        if layout is None:
            layout = self._stats_layout[rec.optimizer] = {
                "params": list(encoding.from_json(st.attrs[schema.STATS_PARAMS])),
                "columns": list(encoding.from_json(st.attrs[schema.STATS_COLUMNS]))}
            layout["param_index"] = {n: i for i, n in enumerate(layout["params"])}
            layout["column_index"] = {c: i for i, c in enumerate(layout["columns"])}
        params, columns = layout["params"], layout["columns"]
        param_index, column_index = layout["param_index"], layout["column_index"]
        new_params = [name for name in rec.stats if name not in param_index]
        new_columns = []
        for values in rec.stats.values():
            for c in values:
                if c not in column_index:
                    column_index[c] = len(columns)
                    columns.append(c)
                    new_columns.append(c)
        for name in new_params:
            param_index[name] = len(params)
            params.append(name)
        if schema.VALUES not in st:
            # Chunks of up to 64 steps, at most 512 KiB: appends stay in HDF5's default 1 MiB chunk cache until the
            # chunk is full, and a 10,000-step table loads in a few dozen reads.
            values = schema.STATS_TABLE.dataset(schema.VALUES)
            row_bytes = max(1, len(params)) * max(1, len(columns)) * np.dtype(values.dtype).itemsize
            rows = int(min(64, max(1, (512 << 10) // row_bytes)))
            _create(st, values, shape=(0, len(params), len(columns)),
                    chunks=(rows, max(1, len(params)), max(1, len(columns))))
        ds = st[schema.VALUES]
        if ds.shape[1] < len(params) or ds.shape[2] < len(columns):
            ds.resize((ds.shape[0], len(params), len(columns)))
        if new_params or new_columns:
            st.attrs[schema.STATS_PARAMS] = encoding.to_json(params)
            st.attrs[schema.STATS_COLUMNS] = encoding.to_json(columns)
        if new_params:
            meta = encoding.from_json(st.attrs[schema.STATS_PARAM_META])
            meta.update({name: rec.stats_meta.get(name, {}) for name in new_params})
            st.attrs[schema.STATS_PARAM_META] = encoding.to_json(meta)
        table = np.full((len(params), len(columns)), np.nan, dtype=ds.dtype)
        for name, values in rec.stats.items():
            r = param_index[name]
            table[r, [column_index[c] for c in values]] = list(values.values())
        self._append(ds, row, table)
        self._append(st[schema.WALL_TIME], row, rec.wall_time)
        self._append_lr(st[schema.LR], row, rec.hparams)

    def _write_full(self, rec: Record) -> None:
        opt = self._optimizer(rec.optimizer)
        record = self._records_written[rec.optimizer]
        for snap in rec.params:
            grp = self._param_group(rec.optimizer, snap)
            row = grp[schema.RECORD_INDEX].shape[0]
            for kind, tensor in ((schema.KIND_PARAM, snap.param), (schema.KIND_GRAD, snap.grad),
                                 (schema.KIND_PARAM_AFTER, snap.param_after)):
                if tensor is not None:
                    self._write_tensor(self._tensor_dataset(grp, kind, tensor, row), row, tensor)
            if snap.state:
                self._write_state(grp, row, snap.state)
            elif grp[schema.STATE_PRESENT].shape[1]:
                self._append(grp[schema.STATE_PRESENT], row, np.zeros(grp[schema.STATE_PRESENT].shape[1], "u1"))
            self._append(grp[schema.RECORD_INDEX], row, record)

        rec_grp = opt[schema.RECORDS]
        self._append(rec_grp[schema.BACKWARD_PASS], record, rec.backward_pass)
        self._append(rec_grp[schema.WALL_TIME], record, rec.wall_time)
        self._append(rec_grp[schema.HPARAMS], record, encoding.to_json(rec.hparams))
        if schema.CLOSURE_LOSSES in rec_grp:  # optional: a resumed run written before it existed goes on without it
            self._append(rec_grp[schema.CLOSURE_LOSSES], record, encoding.to_json(rec.closure_losses))
        self._append_lr(rec_grp[schema.LR], record, rec.hparams)

    def _append_lr(self, lr: h5py.Dataset, row: int, hparams: list) -> None:
        """One row of per-param-group lr; the group axis grows with add_param_group, NaN for absent groups."""
        if lr.shape[1] < len(hparams):
            lr.resize(len(hparams), axis=1)
        lr_row = np.full(lr.shape[1], np.nan)
        lr_row[: len(hparams)] = [encoding.lr_of(g) for g in hparams]
        self._append(lr, row, lr_row)

    def _write_state(self, grp: h5py.Group, row: int, state: dict) -> None:
        st = grp[schema.STATE_GROUP]
        keys = encoding.from_json(st.attrs[schema.STATE_KEYS])
        for key in state:
            if key not in keys:
                keys.append(key)
        present_ds = grp[schema.STATE_PRESENT]
        if present_ds.shape[1] < len(keys):
            present_ds.resize(len(keys), axis=1)
            st.attrs[schema.STATE_KEYS] = encoding.to_json(keys)
        present = np.zeros(len(keys), "u1")
        for i, key in enumerate(keys):
            if key in state:
                storage = encoding.state_storage_dtype(state[key], self.storage_dtype)
                self._write_tensor(self._tensor_dataset(st, key, state[key], row, storage), row, state[key])
                present[i] = 1
        self._append(present_ds, row, present)

    def add_dump(self, info: dict) -> None:
        """Append a flight-recorder dump (reason, trigger step, steps written) to /flight_dumps."""
        self._locks.begin()
        if schema.FLIGHT_DUMPS not in self.file:
            _create(self.file, schema.ROOT.dataset(schema.FLIGHT_DUMPS))
        ds = self.file[schema.FLIGHT_DUMPS]
        self._append(ds, ds.shape[0], encoding.to_json(info))
        self._flushed()

    def set_attr(self, name: str, value) -> None:
        self._locks.begin()
        self.file.attrs[name] = encoding.to_json(value)
        self._flushed()

    def abort(self) -> None:
        """Close after a failure, writing nothing more: what was committed stays readable."""
        try:
            if self.file.id.valid:
                self.file.close()
        except Exception:
            pass
        finally:
            self._locks.close()

    def _trim(self) -> None:
        """Cut the unused part of the last reservation from a cleanly closed run (HDF5 keeps the file's length)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return
        try:
            end = self._end_of_allocation(fd)
            if end is not None and os.fstat(fd).st_size > end:
                os.ftruncate(fd, end)
        except OSError:
            pass  # a longer file reads the same
        finally:
            os.close(fd)

    def close(self) -> None:
        try:
            if self.file.id.valid:
                self._locks.begin()
                self.file.flush()
                self.file.close()
                self._trim()
        finally:
            self._locks.close()
