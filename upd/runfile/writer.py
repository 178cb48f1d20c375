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
from types import SimpleNamespace

import h5py
import numpy as np
import torch

from .. import lifetime
from . import encoding, param_index, schema
from .datasets import create_dataset, create_declared
from .full_rows import ParamRows, RecordRows, ScalarRows
from .guards import SUPERBLOCK_BYTES, parse_superblock
from .livelock import WriterLocks
from .record import ParamSnapshot, Record, param_meta
from .stats_table import StatsTableWriter

try:
    import fcntl  # POSIX: HDF5's own lock is a flock
except ImportError:  # pragma: no cover - Windows
    fcntl = None
try:
    import resource  # POSIX: the file-size limit counts as space
except ImportError:  # pragma: no cover - Windows
    resource = None


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


def index_from_file(params: h5py.Group, committed: int) -> list[dict]:
    """The parameter index entries of an optimizer's params group, read from its groups (a run this writer
    resumed: its earlier groups were written by another session)."""
    entries = []
    for key, grp in params.items():
        entry = param_index.entry(key, encoding.from_json(grp.attrs[schema.ATTR_META]))
        entry[param_index.ROWS] = int((grp[schema.RECORD_INDEX][()] < committed).sum())
        entry[param_index.KINDS] = {kind: _text(grp[kind].attrs[schema.ATTR_TORCH_DTYPE])
                                    for kind in schema.TENSOR_KINDS if kind in grp}
        entry[param_index.STATE_KEYS] = encoding.from_json(grp[schema.STATE_GROUP].attrs[schema.STATE_KEYS])
        entries.append(entry)
    return entries


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _lock_before_truncating(path: str) -> WriterLocks | None:
    """The writer's lock on an existing run that overwrite=True is about to replace (None when there is no file):
    OSError(EBUSY) when a recorder has it open for writing (torch-upd's lock), or any HDF5 writer (HDF5's own
    exclusive lock), before a byte of it is truncated."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    try:
        if fcntl is not None:
            try:  # shared: a reader's shared lock is no obstacle, a writer's exclusive one is
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OSError(errno.EBUSY, f"{path} is being written by another process; not replaced") from None
            except OSError:
                pass  # a filesystem without flock: torch-upd's own lock below still decides
    finally:
        os.close(fd)  # releases the flock: HDF5 takes its own
    try:
        return WriterLocks(path)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise OSError(errno.EBUSY, f"{path} is being written by another process; not replaced") from None
        raise


def _descriptor(file: h5py.File) -> int:
    """The OS descriptor HDF5 writes the run through (-1 for a driver without one)."""
    try:
        return int(file.id.get_vfd_handle())
    except Exception:
        return -1


# The HDF5 1.10 object formats: a chunked dataset with one unlimited dimension is indexed by an extensible array,
# which appends and never moves an entry. The default format's B-tree moves the entries of a full node into new ones
# (every dataset's root at its 65th chunk), and the flush writes the old node before the new ones and the superblock:
# a SIGKILL in between left committed records unreadable (benchmarks/flush_kill.py; docs/reliability.md). The
# superblock stays at version 0: version 3, which the 1.10 bounds would choose for a file they create, marks the file
# open for writing, and a killed writer's mark makes HDF5 refuse the file.
OBJECT_FORMATS = ("v110", "v110")


class RunWriter:
    def __init__(self, path: str, meta: dict, *, overwrite: bool, storage_dtype: str, compression,
                 resume: bool = False):
        self.path = os.fspath(path)
        self.storage_dtype = storage_dtype
        self.compression = compression
        self._records_written: dict[int, int] = {}
        self._stats_tables: dict[int, StatsTableWriter] = {}  # optimizer -> its statistics table, kept open
        # Full records' datasets, kept open (full_rows.py): optimizer -> its record table; (optimizer, parameter
        # name) -> the parameter's group.
        self._record_rows: dict[int, RecordRows] = {}
        self._param_rows: dict[tuple, ParamRows] = {}
        self._scalar_rows: dict[int, ScalarRows] = {}  # optimizer -> its logged-scalars table, kept open
        # The parameter index written at close (param_index.py): optimizer -> {group name: entry}, kept up to date
        # as rows are written; the last record each optimizer wrote rows for; optimizers whose groups predate this
        # writer (resume=True), whose index is rebuilt from the file instead.
        self._param_index: dict[int, dict[str, dict]] = {}
        self._index_last_record: dict[int, int] = {}
        self._index_from_file: set[int] = set()
        # Objects created lazily (a parameter's group at its first record, a tensor or state dataset appearing in a
        # group readers can already see, the statistics and scalars tables at their first rows) are created
        # unlinked and linked into the file at the commit of the record that brought them, with the attributes that
        # name them: until then no reader can reach them, so a kill while they are being written (a large first
        # record, a new param group, a new state key) leaves the file as its last commit left it. HDF5 can write a
        # visible group's changed link table to disk before the flush, past the end the superblock records, which
        # made such files unreadable ("addr overflow").
        self._unlinked: dict = {}  # ObjectID of an unlinked group (and of the groups inside it) -> the group
        self._to_link: list[tuple] = []  # (parent group, name, object), linked at the next commit, in order
        self._at_commit: list = []  # changes (attribute writes) made at the next commit, after the links
        if resume and os.path.exists(self.path):
            self._reopen(meta)
            return
        mode = "w" if overwrite else "w-"
        if os.path.islink(self.path):  # "w" would truncate the link's target, "w-" refuses it as existing anyway
            raise FileExistsError(f"{self.path} is a symbolic link; a run is never written through one (overwrite=True "
                                  "replaces files, not what a link points to): remove the link or record to its target")
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)  # upd.record("runs/exp1.h5", ...) creates runs/
        # overwrite=True: the run's lock first, then the truncation. HDF5 truncates before its own lock refuses a
        # second writer, which would destroy a live run while its recorder goes on writing into nothing.
        locks = _lock_before_truncating(self.path) if overwrite else None
        try:
            self._open_file(mode)
        except FileExistsError:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it") from None
        except BaseException:
            if locks is not None:
                locks.close()
            raise
        if locks is None:
            self._lock_file()
        else:
            self._locks = locks
            locks.begin()
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
            self._close_file()
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
        self._open_file("r+")
        self._lock_file()
        self._inode = os.stat(self.path).st_ino
        if self.file.attrs.get(schema.ATTR_FORMAT) != schema.FORMAT_NAME or \
                self.file.attrs.get(schema.ATTR_VERSION) != schema.FORMAT_VERSION:
            self._close_file()
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
            if schema.PARAM_INDEX in opt[schema.PARAMS].attrs:  # it will not describe what this session appends
                del opt[schema.PARAMS].attrs[schema.PARAM_INDEX]
            self._index_from_file.add(int(key))
            _truncate(records, schema.RECORD_TABLE, committed)
            for grp in opt[schema.PARAMS].values():
                valid = int((grp[schema.RECORD_INDEX][()] < committed).sum())
                _truncate(grp, schema.PARAMETER, valid)
                _truncate(grp[schema.STATE_GROUP], schema.STATE, valid)
            if schema.STATS in opt:
                stats = opt[schema.STATS]
                _truncate(stats, schema.STATS_TABLE, int(stats[schema.COMMIT_COLUMN].shape[0]))
            if schema.SCALARS in opt:
                scalars = opt[schema.SCALARS]
                _truncate(scalars, schema.SCALARS_TABLE, int(scalars[schema.COMMIT_COLUMN].shape[0]))
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

    def truncate_from(self, index: int, step: int) -> dict:
        """Drop optimizer `index`'s committed rows of steps at and after `step` (a run resumed from a checkpoint
        older than its last recorded step: those steps were trained again, docs/reliability.md, "Resuming");
        return {"records", "stats_rows", "scalar_rows"} dropped, and note it in the run's last ``resumes`` entry.

        The commit columns are cut first and flushed: a kill before the rest is cut leaves rows beyond the commits,
        which readers ignore and the next resume drops, like any uncommitted row."""
        grp = self._optimizer(index)
        if grp is None:
            return {"records": 0, "stats_rows": 0, "scalar_rows": 0}
        tables = {"records": (grp[schema.RECORDS], schema.RECORD_TABLE),
                  "stats_rows": (grp[schema.STATS], schema.STATS_TABLE) if schema.STATS in grp else None,
                  "scalar_rows": (grp[schema.SCALARS], schema.SCALARS_TABLE) if schema.SCALARS in grp else None}
        keep, dropped = {}, {}
        for label, found in tables.items():
            if found is None:
                dropped[label] = 0
                continue
            steps = found[0][schema.COMMIT_COLUMN][()]
            later = np.nonzero(steps >= step)[0]
            keep[label] = int(later[0]) if len(later) else len(steps)  # rows are in step order
            dropped[label] = len(steps) - keep[label]
        if not any(dropped.values()):
            return dropped
        self._locks.begin()
        for label, rows in keep.items():
            tables[label][0][schema.COMMIT_COLUMN].resize(rows, axis=0)
        self.file.flush()
        for label, rows in keep.items():
            _truncate(*tables[label], rows)
        for param in grp[schema.PARAMS].values():
            valid = int((param[schema.RECORD_INDEX][()] < keep["records"]).sum())
            _truncate(param, schema.PARAMETER, valid)
            _truncate(param[schema.STATE_GROUP], schema.STATE, valid)
        self._records_written[index] = keep["records"]
        resumes = encoding.from_json(self.file.attrs.get(schema.ATTR_RESUMES, "[]"))
        if resumes:
            resumes[-1].setdefault("truncated", []).append({"optimizer": index, "from_step": int(step), **dropped})
            self.file.attrs[schema.ATTR_RESUMES] = encoding.to_json(resumes)
        self._flushed()
        return dropped

    # -- structure -------------------------------------------------------------------------------------------
    def add_optimizer(self, index: int, meta: dict) -> None:
        if self._optimizer(index) is not None:  # resuming: the optimizer's structure is there already
            return
        self._locks.begin()
        grp = self.file[schema.OPTIMIZERS].create_group(str(index))
        grp.attrs[schema.ATTR_META] = encoding.to_json(meta)
        create_declared(grp.create_group(schema.RECORDS), schema.RECORD_TABLE)
        grp.create_group(schema.PARAMS)
        self._records_written[index] = 0
        self._flushed()

    # -- objects hidden from readers until their commit ------------------------------------------------------
    def _pending(self, parent: h5py.Group, name: str):
        """The unlinked object to be linked as parent[name] at the next commit, or None."""
        return next((obj for p, n, obj in self._to_link if n == name and p.id == parent.id), None)

    def _hidden_group(self, parent: h5py.Group, name: str) -> h5py.Group:
        """parent[name] as a new group linked at the next commit (at once inside a group that is itself unlinked)."""
        found = self._pending(parent, name)
        if found is not None:
            return found
        if parent.id in self._unlinked:
            grp = parent.create_group(name)
        else:
            grp = h5py.Group(h5py.h5g.create(parent.id, None))
            self._to_link.append((parent, name, grp))
        self._unlinked[grp.id] = grp
        return grp

    def _hidden_dataset(self, parent: h5py.Group, name: str, **create) -> h5py.Dataset:
        """parent.create_dataset(name, **create), linked at the next commit unless parent is itself unlinked."""
        if parent.id in self._unlinked:
            return parent.create_dataset(name, **create)
        ds = parent.create_dataset(None, **create)
        self._to_link.append((parent, name, ds))
        return ds

    def _defer(self, change) -> None:
        """Make `change` (a callable) at the next commit: an attribute naming objects linked then."""
        self._at_commit.append(change)

    def _link_pending(self) -> None:
        """The commit's first part: link what was created for the records being committed, make deferred changes."""
        for parent, name, obj in self._to_link:
            parent[name] = obj
            self._unlinked.pop(getattr(obj, "id", None), None)
        for change in self._at_commit:
            change()
        self._to_link, self._at_commit = [], []
        self._unlinked = {}  # every group created so far is reachable now

    def _param_group(self, optimizer: int, snap: ParamSnapshot) -> h5py.Group:
        params = self._optimizer(optimizer)[schema.PARAMS]
        key = schema.param_key(snap.name)  # '/' would be an HDF5 path separator: escaped, reversibly
        if key in params:
            return params[key]
        grp = self._hidden_group(params, key)
        if schema.RECORD_INDEX in grp:  # made for a record whose write failed: not linked yet, filled already
            return grp
        reference = snap.param if snap.param is not None else snap.grad if snap.grad is not None else snap.param_after
        meta = param_meta(snap, reference)
        grp.attrs[schema.ATTR_META] = encoding.to_json(meta)
        self._param_index.setdefault(optimizer, {})[key] = param_index.entry(key, meta)
        create_declared(grp, schema.PARAMETER)  # the record index and state_present; tensors at their first row
        st = grp.create_group(schema.STATE_GROUP)
        self._unlinked[st.id] = st  # inside an unlinked group: its datasets are created linked to it
        st.attrs[schema.STATE_KEYS] = encoding.to_json([])
        return grp

    def _tensor_dataset(self, grp: h5py.Group, name: str, tensor: torch.Tensor, rows: int,
                        storage: str | None = None) -> h5py.Dataset:
        if name in grp:
            return grp[name]
        found = self._pending(grp, name)
        if found is not None:
            return found
        np_dtype, stored_as = encoding.storage_numpy_dtype(tensor.dtype, storage or self.storage_dtype)
        shape = tuple(tensor.shape)
        # A 0 dimension (a rank's empty shard) must be resizable for its chunk of 1 to fit; it is never resized.
        ds = self._hidden_dataset(grp, name, shape=(rows, *shape), maxshape=(None, *(d or None for d in shape)),
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

    def _check_space(self, recs: list) -> int:
        """Refuse records the disk (or the process's file-size limit) cannot take, before writing any of them;
        return the bytes they may need. The slack for metadata growth is counted once per write, not once per
        record: a batch of 64 statistics rows of ~160 bytes each needs tens of KB, not 64 times the slack.

        HDF5 updates metadata in place: a write that fails half-way (ENOSPC, EFBIG) can leave metadata pointing past
        the end of the file, and the whole run unreadable. Stopping one record early keeps every committed step."""
        nbytes, datasets = 0, 4
        for rec in recs:
            for snap in rec.params if rec.full else ():
                for t in (snap.param, snap.grad, snap.param_after, *snap.state.values()):
                    if t is not None:
                        nbytes += t.numel() * t.element_size()
                        datasets += 1
            if rec.stats is not None:
                nbytes += 64 * len(rec.stats) * 4
            nbytes += sum(8 * (len(values) + 2) for _, _, values in rec.scalars)
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

    def write(self, rec: Record | list) -> None:
        """Write one step (full tensors, statistics, or both) with the commit protocol; or a list of steps in one
        go (AsyncRunWriter batches statistics-only steps, and full records already queued): all their rows, one
        flush, all their commits, one flush. A kill at any moment leaves each of them wholly committed or absent."""
        recs = rec if isinstance(rec, list) else [rec]
        self._check_still_there()
        need = self._check_space(recs)
        self._locks.begin()  # the reservation changes the file's length: a live reader must not be copying it
        self._reserve(need)
        full, stats, scalars = {}, {}, {}  # optimizer -> its full records / statistics records / scalar rows, in order
        for rec in recs:
            if rec.full:
                full.setdefault(rec.optimizer, []).append(rec)
            if rec.stats is not None:
                stats.setdefault(rec.optimizer, []).append(rec)
            if rec.scalars:
                scalars.setdefault(rec.optimizer, []).extend(rec.scalars)
        for index, batch in full.items():
            self._write_full(index, batch)
        scalar_blocks = [SimpleNamespace(optimizer=index, scalars=rows) for index, rows in scalars.items()]
        for block in scalar_blocks:
            self._write_scalars(block)
        for index, rows in stats.items():
            self._stats_table(index).write(rows)
        self.file.flush()
        self._reserve(256 << 10)  # the commit below grows a few B-trees: it must not be the write that fails
        # The commit: a record exists for readers once its step is appended, and only after its rows are durable;
        # what it created becomes reachable with it.
        self._link_pending()
        for index, rows in stats.items():
            self._stats_table(index).commit(rows)
        for index, batch in full.items():
            self._records_of(index).commit(self._records_written[index], [rec.step for rec in batch])
            self._records_written[index] += len(batch)
        for block in scalar_blocks:
            self._commit_scalars(block)
        self._flushed()

    def _commit_scalars(self, rec) -> None:
        """Append the steps of `rec.scalars` (a record's, or a batch's of one optimizer) to its scalars table."""
        if rec.scalars:
            self._scalars_of(rec.optimizer).commit(rec.scalars)

    def _stats_table(self, optimizer: int) -> StatsTableWriter:
        table = self._stats_tables.get(optimizer)
        if table is None:
            table = self._stats_tables[optimizer] = StatsTableWriter(self._optimizer(optimizer), self._hidden_group)
        return table

    def _scalars_of(self, optimizer: int) -> ScalarRows:
        """The optimizer's logged-scalars table, created at its first row."""
        found = self._scalar_rows.get(optimizer)
        if found is None:
            opt = self._optimizer(optimizer)
            if schema.SCALARS in opt:
                table = opt[schema.SCALARS]
            else:
                table = self._hidden_group(opt, schema.SCALARS)  # linked with its first rows' commit
                if schema.SCALAR_COLUMNS not in table.attrs:
                    create_declared(table, schema.SCALARS_TABLE)
                    table.attrs[schema.SCALAR_COLUMNS] = encoding.to_json([])
            found = self._scalar_rows[optimizer] = ScalarRows(table)
        return found

    def _write_scalars(self, rec: Record) -> None:
        """The record's logged scalars as rows of the scalars table (committed by the caller, with its step)."""
        self._scalars_of(rec.optimizer).write(rec.scalars)

    def _records_of(self, optimizer: int) -> RecordRows:
        found = self._record_rows.get(optimizer)
        if found is None:
            found = self._record_rows[optimizer] = RecordRows(self._optimizer(optimizer)[schema.RECORDS])
        return found

    def _write_full(self, optimizer: int, recs: list[Record]) -> None:
        """The rows of full records of one optimizer, in order (the records that follow its committed ones): each
        parameter's rows of all of them together, then the record table's (full_rows.py)."""
        first = self._records_written[optimizer]
        by_param: dict[str, list] = {}  # parameter name -> (snapshot, record) of each record holding it
        for i, rec in enumerate(recs):
            for snap in rec.params:
                by_param.setdefault(snap.name, []).append((snap, first + i))
        for name, items in by_param.items():
            rows = self._param_rows.get((optimizer, name))
            if rows is None:
                rows = self._param_rows[optimizer, name] = ParamRows(
                    self._param_group(optimizer, items[0][0]), self._tensor_dataset, self.storage_dtype,
                    self._defer)
            row = rows.rows
            state_keys = rows.write(*items[0], more=items[1:])
            for i, (snap, record) in enumerate(items):
                self._index_row(optimizer, record, snap, row + i + 1, state_keys)
        self._records_of(optimizer).write(first, recs)

    def _index_row(self, optimizer: int, record: int, snap: ParamSnapshot, rows: int, state_keys) -> None:
        """The parameter index after a row of `snap` was written (the index is written at close)."""
        self._index_last_record[optimizer] = record
        found = self._param_index.get(optimizer, {}).get(schema.param_key(snap.name))
        if found is None:  # a group written before a resume: this optimizer's index is read from the file at close
            return
        found[param_index.ROWS] = rows
        kinds = found[param_index.KINDS]
        for kind, tensor in ((schema.KIND_PARAM, snap.param), (schema.KIND_GRAD, snap.grad),
                             (schema.KIND_PARAM_AFTER, snap.param_after)):
            if tensor is not None and kind not in kinds:  # the storage dtype _tensor_dataset chose for it
                kinds[kind] = encoding.storage_numpy_dtype(tensor.dtype, self.storage_dtype)[1]
        if state_keys is not None:
            found[param_index.STATE_KEYS] = list(state_keys)

    def _write_param_index(self) -> None:
        """Write each optimizer's parameter index (param_index.py) as the run is closed: every row is committed
        then. Left out where it would not hold: rows of a record that was never committed (a write failed), more
        text than a reader accepts, or no room on the disk (readers then read the parameters' groups)."""
        for index, committed in sorted(self._records_written.items()):
            params = self._optimizer(index)[schema.PARAMS]
            if self._index_last_record.get(index, -1) >= committed:
                continue
            if index in self._index_from_file:
                entries = index_from_file(params, committed)
            else:
                entries = list(self._param_index.get(index, {}).values())
            text = encoding.to_json(param_index.document(committed, entries))
            if len(text) > schema.MAX_META_BYTES:
                continue
            try:
                self._reserve(2 * len(text) + (64 << 10))
            except OSError:
                return
            params.attrs[schema.PARAM_INDEX] = text

    def add_dump(self, info: dict) -> None:
        """Append a flight-recorder dump (reason, trigger step, steps written) to /flight_dumps."""
        self._locks.begin()
        if schema.FLIGHT_DUMPS not in self.file:
            create_dataset(self.file, schema.ROOT.dataset(schema.FLIGHT_DUMPS))
        ds = self.file[schema.FLIGHT_DUMPS]
        self._append(ds, ds.shape[0], encoding.to_json(info))
        self._flushed()

    def add_events(self, events: list[dict]) -> None:
        """Append live alerts (docs/format.md, ``events``) to /events, one JSON object each."""
        if not events:
            return
        self._locks.begin()
        if schema.EVENTS not in self.file:
            create_dataset(self.file, schema.ROOT.dataset(schema.EVENTS))
        ds = self.file[schema.EVENTS]
        start = ds.shape[0]
        ds.resize(start + len(events), axis=0)
        ds[start:] = [encoding.to_json(event) for event in events]
        self._flushed()

    def set_attr(self, name: str, value) -> None:
        self._locks.begin()
        self.file.attrs[name] = encoding.to_json(value)
        self._flushed()

    def _open_file(self, mode: str) -> None:
        """Open for writing: a new file is created in HDF5's default format (superblock version 0), then reopened
        with the HDF5 1.10 object formats (OBJECT_FORMATS), which every dataset and group made from then on uses."""
        if mode != "r+":
            h5py.File(self.path, mode).close()
        self.file = h5py.File(self.path, "r+", libver=OBJECT_FORMATS)
        lifetime.written_through(_descriptor(self.file))  # a forked child gets /dev/null in its place

    def _close_file(self) -> None:
        lifetime.no_longer_written(_descriptor(self.file))
        self.file.close()

    def abort(self) -> None:
        """Close after a failure, writing nothing more: what was committed stays readable."""
        try:
            if self.file.id.valid:
                self._close_file()
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
                try:
                    self._write_param_index()
                finally:
                    self.file.flush()
                    self._close_file()
                    self._trim()
        finally:
            self._locks.close()
