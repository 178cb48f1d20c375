"""HDF5 writing off the training thread: a RunWriter driven by one background thread through a bounded queue.

Measured on an emulated training loop (0.6 s steps, 179 MB recorded per step; h5py 3.16, HDF5 2.0.0, 2 cores):
writing full tensors inline slowed it by +24%; handing copied snapshots to a background thread through a bounded
queue of 2 cost +5%, because h5py releases the GIL inside the actual write (a writer process with shared memory cost
+10%: its hand-off copy took 54-58 ms per step, the thread's 19-21 ms). ``AsyncRunWriter`` is that design:

* ``write(rec)`` puts the snapshot on a ``queue.Queue(maxsize=max_pending)`` and returns. When the queue is full it
  blocks until the writer thread takes one: training waits rather than memory growing. At most ``max_pending``
  snapshots are queued plus the one being written. The time spent waiting is ``blocked_seconds``; if it keeps
  growing, the writer's sustained rate is below bytes per step / step time.
* Everything that touches HDF5 (opening the file, ``add_optimizer``, ``set_attr``, every record, ``close``) runs on
  the one writer thread, in the order it was called. ``RunWriter.write`` keeps the commit protocol (rows, flush,
  then the step marker, flush), so a reader never sees a half-written record.
* Statistics-only records are committed in batches: up to ``HOLD_ROWS`` of them (``HOLD_CELLS`` rows x parameters),
  for at most ``HOLD_SECONDS``, written with one commit (``RunWriter.write`` of a list). One at a time, a statistics
  row cost 6.7 ms of writer time on a 29-parameter model (flushes, per-dataset calls); in a batch of 64 about 0.07
  ms, in a batch of 256 about 0.03 ms (docs/performance.md); on such a model a second of steps is several hundred
  rows, so the batch is bounded by time more than by rows. A batch is a list the
  training thread appends to (``_Batch``): only its first row goes through the queue, as the batch itself, and wakes
  the writer thread, which then sleeps until the batch's deadline, until it is full, or until anything else is
  queued. Putting every row on the queue woke the writer thread at every step, a GIL round trip that cost 0.25 ms
  of writer CPU per row on that model, more than the batched write itself. Held records are written before any
  other item (a full record, a call, ``close``), so the file's order is the call order; a crash loses at most the
  held rows, never a committed one, and a live reader sees them at most ``HOLD_SECONDS`` late.
  ``records_written`` counts a record once it is committed.
* Full records are never held back, but those already queued behind the one the writer thread takes are written
  with it, with one commit (``_write_record``, at most ``FULL_BATCH``); they keep their places in the queue until
  written, so the memory bound above holds.
* An exception on the writer thread is not lost: the first one is kept, the file is closed, nothing more is
  written, and it is raised (the same exception object) from the next ``write()`` (and every later one);
  ``close()`` raises it if no call has raised it yet. ``add_dump`` (called during training) is queued like a
  record. Opening the file, ``add_optimizer``, ``set_attr``, ``optimizer_meta``, ``last_step`` (setup and
  teardown calls; any other RunWriter method is forwarded the same way) wait for their result, so their errors
  surface at the call.
* The thread is a daemon, so a process never hangs on it; at exit ``upd.lifetime`` drains and closes writers that
  are still open (it holds them weakly, so writers can still be garbage collected; a collected writer finishes its
  queue and closes its file on its own thread, which the exit waits for).

The caller hands over ownership of each record: it must not modify a snapshot's tensors after ``write()``. The
recorder's snapshots are fresh CPU copies, so this holds.
"""
from __future__ import annotations

import functools
import os
import queue
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Callable

import torch

from . import encoding
from .. import lifetime
from .record import Record
from .stats_table import StatsRows
from .writer import RunWriter

_STOP = object()  # the last item a worker takes: close the file and exit
_WRITE = "write"
_CALL = "call"
_HOLD = "hold"  # a _Batch of statistics-only records; the training thread may still append to it
_BATCH_FULL = "batch full"  # the _Batch queued before is full: write it now
_POLL_SECONDS = 0.05  # how often a blocked put checks that the writer thread is still alive
_BATCH_LOCK_SECONDS = 1.0  # the longest the writer thread waits for a batch the training thread is appending to
# Statistics-only records committed together at most: a commit costs a few milliseconds whatever its rows (two
# flushes, a disk reservation, the live-reading lock), which at 64 rows was most of the writer's time per row on a
# small model (docs/performance.md), and at 256 rows still a third of it on a model whose step takes 2 ms (a batch
# then filled in half a second); and at most this many rows x parameters (what a held batch keeps in memory).
HOLD_ROWS = 1024
HOLD_CELLS = 1 << 17
HOLD_SECONDS = 1.0  # the longest a statistics-only record waits to be committed
FULL_BATCH = 16  # full records committed together at most (those already queued: at most max_pending + 1)


class _SnapshotQueue(queue.Queue):
    """A queue.Queue that also counts the records in it, under the queue's own lock (so the count is exact)."""

    def _init(self, maxsize):
        super()._init(maxsize)
        self.records = 0

    def _put(self, item):
        super()._put(item)
        if item is not _STOP and item[0] == _WRITE:
            self.records += 1

    def _get(self):
        item = super()._get()
        if item is not _STOP and item[0] == _WRITE:
            self.records -= 1
        return item


class _Batch:
    """Statistics-only records committed together. The training thread appends to `rows` while the batch is open;
    the writer thread closes it (`open` = False, under the shared lock) before it writes `rows`, so no row is added
    to a batch being written. ``deadline``: when its first row has waited HOLD_SECONDS."""

    __slots__ = ("rows", "cells", "open", "deadline")

    def __init__(self, first):
        self.rows = [first]
        self.cells = len(first.stats)  # rows x parameters so far
        self.open = True
        self.deadline = time.monotonic() + HOLD_SECONDS

    def full(self) -> bool:
        return len(self.rows) >= HOLD_ROWS or self.cells >= HOLD_CELLS


class _Shared:
    """State the writer thread and the AsyncRunWriter share. The thread holds this, never the AsyncRunWriter itself,
    so an abandoned writer can be garbage collected."""

    def __init__(self, on_written=None):
        self.lock = threading.Lock()
        self.on_written = on_written  # called with each list of records once written (AsyncRunWriter's on_written=)
        self.writer: RunWriter | None = None  # opened on the writer thread
        self.error: BaseException | None = None  # the first exception on the writer thread
        self.reported = False  # the error has been raised on a caller's thread
        self.records_written = 0
        self.bytes_written = 0
        self.write_seconds = 0.0  # wall time the writer thread spent writing records
        self.stopping = False  # set when the writer was garbage collected: drain, close, exit without a join
        self.stopped = False  # no item put after this is ever processed
        self.batch_lock = threading.Lock()  # a _Batch's rows and `open` flag (appending, closing)


@functools.lru_cache(maxsize=None)
def _itemsize(torch_dtype: torch.dtype, storage: str) -> int:
    return encoding.storage_numpy_dtype(torch_dtype, storage)[0].itemsize


def _stored_bytes(rec: Record, storage: str) -> int:
    """Bytes of values the record puts in the file: tensors after the dtype= conversion (before any compression),
    plus 4 bytes per statistic. Small bookkeeping (record table, indices, JSON) is not counted."""
    stats = rec.stats
    total = 4 * (stats.table.size if isinstance(stats, StatsRows) else
                 sum(len(values) for values in (stats or {}).values()))
    if not rec.full:
        return total
    for snap in rec.params:
        for tensor in (snap.param, snap.grad, snap.param_after):
            if tensor is not None:
                total += tensor.numel() * _itemsize(tensor.dtype, storage)
        for tensor in snap.state.values():
            total += tensor.numel() * _itemsize(tensor.dtype, encoding.state_storage_dtype(tensor, storage))
    return total


def _open_writer(shared: _Shared, args: tuple, kwargs: dict) -> None:
    shared.writer = RunWriter(*args, **kwargs)


def _writer_method(shared: _Shared, name: str, *args, **kwargs):
    return getattr(shared.writer, name)(*args, **kwargs)


def _holdable(rec: Record) -> bool:
    """A statistics-only record: committed with others (see HOLD_ROWS)."""
    return not rec.full and rec.stats is not None


def _write(shared: _Shared, payload) -> None:
    """Write one record or a list of them (RunWriter.write takes both) and count them."""
    start = time.perf_counter()
    shared.writer.write(payload)
    elapsed = time.perf_counter() - start
    recs = payload if isinstance(payload, list) else [payload]
    nbytes = sum(_stored_bytes(rec, getattr(shared.writer, "storage_dtype", "keep")) for rec in recs)
    with shared.lock:
        shared.records_written += len(recs)
        shared.bytes_written += nbytes
        shared.write_seconds += elapsed
    _after_written(shared, recs)


def _after_written(shared: _Shared, recs: list) -> None:
    """Hand the records just written to the on_written hook. The hook's exceptions are its own, never the file's:
    warned once, and the hook is called no more."""
    hook = shared.on_written
    if hook is None:
        return
    try:
        hook(recs)
    except Exception as exc:
        shared.on_written = None
        warnings.warn(f"torch-upd: the run file's on_written hook failed ({type(exc).__name__}: {exc}) and is "
                      "called no more; the file goes on.", RuntimeWarning, stacklevel=2)


def _run_quietly(fn) -> None:
    """fn() on the writer thread (AsyncRunWriter.run_later): its exceptions are warned about, never the file's."""
    try:
        fn()
    except Exception as exc:
        warnings.warn(f"torch-upd: a call on the run file's writer thread failed ({type(exc).__name__}: {exc}); "
                      "the file goes on.", RuntimeWarning, stacklevel=2)


def _tensor_layout(t) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype)


def _layout(rec: Record) -> tuple:
    """What a full record's rows look like: which parameters, tensors, state keys, with their shapes and dtypes.
    Records committed together must share it: a record the writer refuses (a parameter that changed shape, a new
    tensor kind) fails its whole batch, and the records queued before it must not fail with it."""
    return tuple((snap.name, _tensor_layout(snap.param), _tensor_layout(snap.grad), _tensor_layout(snap.param_after),
                  tuple((key, _tensor_layout(value)) for key, value in snap.state.items()))
                 for snap in rec.params)


def _write_record(q: _SnapshotQueue, shared: _Shared, rec: Record) -> None:
    """Write a record; a full one together with the full records queued right behind it, with one commit for all
    (one pair of flushes, each dataset grown once, small rows one write each: in batches of 3, about a third less
    writer CPU per record on a 6-parameter model, docs/performance.md). Only what is already queued is taken, never
    waited for, and it stays in the queue, holding its place, until written: the queue bound is still the memory
    bound. A kill leaves each record wholly committed or absent (``RunWriter.write``)."""
    more = []
    if rec.full:
        layout = None
        with q.mutex:
            for item in q.queue:
                if len(more) + 1 >= FULL_BATCH or item is _STOP or item[0] != _WRITE or not item[1].full \
                        or item[1].optimizer != rec.optimizer:
                    break
                layout = _layout(rec) if layout is None else layout
                if _layout(item[1]) != layout:
                    break
                more.append(item[1])
    try:
        _write(shared, [rec, *more] if more else rec)
    finally:
        for _ in more:  # only this thread takes from the queue: its first items are these
            q.get_nowait()


def _fail(shared: _Shared, exc: BaseException, future=None) -> None:
    shared.error = exc
    if future is not None:
        future.set_exception(exc)
    _abort(shared.writer)  # nothing more is written: release the file now


def _worker(q: _SnapshotQueue, shared: _Shared) -> None:
    held: _Batch | None = None  # the batch of statistics-only records not yet written (HOLD_ROWS)

    def write_held():
        nonlocal held
        batch, held = held, None
        if batch is None:
            return
        # From here on the training thread starts a new batch instead of appending to this one. The lock is held
        # there for one append; a signal handler that interrupts it and closes the writer (its own SIGTERM handler:
        # the recorder defers those around its writes) waits for this thread, which therefore does not wait for
        # the lock for long: a row appended then is one handed over while the writer was being closed.
        locked = shared.batch_lock.acquire(timeout=_BATCH_LOCK_SECONDS)
        batch.open = False
        if locked:
            shared.batch_lock.release()
        if shared.error is None:
            try:
                _write(shared, batch.rows)
            except BaseException as exc:  # kept for the training thread; this thread must go on draining
                _fail(shared, exc)

    try:
        while True:
            try:
                item = q.get(timeout=max(0.0, held.deadline - time.monotonic()) if held is not None else None)
            except queue.Empty:  # the held batch's first record has waited HOLD_SECONDS
                write_held()
                continue
            if item is _STOP:
                write_held()
                break
            kind, payload, future = item
            item = None
            if kind == _BATCH_FULL:
                if payload is held:
                    write_held()
            elif kind == _HOLD:
                write_held()  # the batch before it is closed: the training thread appends to this one only
                if shared.error is None:
                    held = payload
            else:
                write_held()  # everything before this item is written first: the file keeps the call order
                if shared.error is not None:  # failed before: write nothing more, but answer anyone waiting
                    if future is not None:
                        future.set_exception(shared.error)
                else:
                    try:
                        if kind == _WRITE:
                            _write_record(q, shared, payload)
                        else:
                            result = payload()
                            if future is not None:
                                future.set_result(result)
                    except BaseException as exc:  # kept for the training thread; this thread must go on draining
                        _fail(shared, exc, future)
            # Drop the snapshot before waiting for the next one: the queue bound is also the memory bound.
            payload = future = result = None
            if shared.stopping and q.empty():
                write_held()
                break
    finally:
        shared.stopped = True
        if shared.error is not None:
            _abort(shared.writer)
        else:
            try:
                if shared.writer is not None:
                    shared.writer.close()
            except BaseException as exc:
                shared.error = exc
                _abort(shared.writer)
        lifetime.writer_threads.discard(threading.current_thread())


def _abort(writer) -> None:
    """Close a writer that failed, writing nothing more (RunWriter.abort: no flush into a broken file)."""
    try:
        if writer is not None:
            (getattr(writer, "abort", None) or writer.close)()
    except BaseException:
        pass  # a second error after the first: the first is the one reported


def _release(q: _SnapshotQueue, thread: threading.Thread, shared: _Shared) -> None:
    """Finalizer of a writer that was garbage collected without close(): let its thread drain the queue, close
    the file and exit. It must not block or join: the collection may run on the writer thread itself, or on a
    thread holding h5py's lock that the writer thread needs."""
    shared.stopping = True
    lifetime.writer_threads.add(thread)
    try:
        q.put_nowait(_STOP)
    except queue.Full:
        pass  # the queue is not empty, so the thread is not waiting: it sees `stopping` once it has drained


class AsyncRunWriter:
    """A :class:`RunWriter` whose HDF5 writes happen on one background thread, fed by a bounded queue.

    ``AsyncRunWriter(path, meta, overwrite=..., storage_dtype=..., compression=..., max_pending=2)`` takes the
    RunWriter arguments and opens the file (on the writer thread; errors such as FileExistsError are raised here).
    ``before_full_write``: called before a record with full tensors is queued, so that the writer thread never
    reads a tensor still being copied (the recorder passes the wait for its non_blocking device-to-host copies).
    ``on_written``: a callable given each list of records once they are written (on the writer thread, in the
    order written; its exceptions are warned about and stop the hook, never the file): how the recorder feeds its
    live sinks without this module knowing them.

    Same interface as RunWriter for the recorder: ``write(rec)``, ``set_attr(name, value)``,
    ``add_optimizer(index, meta)``, ``optimizer_meta(index)``, ``last_step(index)``, ``add_dump(info)``,
    ``close()``, ``abort()``. Also ``pending`` (records queued, not yet taken by the writer thread),
    ``records_written``, ``bytes_written`` (values those records put in the file, see ``_stored_bytes``),
    ``write_seconds`` (the writer thread's time writing them),
    ``blocked_seconds`` (total time ``write()`` waited for queue space) and ``error`` (the writer thread's first
    exception).
    """

    def __init__(self, *args, max_pending: int = 2, before_full_write: Callable[[], None] | None = None,
                 on_written=None, **kwargs):
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive integer, got {max_pending!r}")
        self.max_pending = max_pending
        self._before_full_write = before_full_write
        self.path = os.fspath(args[0] if args else kwargs["path"])
        self.blocked_seconds = 0.0
        self._closed = False
        self._close_lock = threading.RLock()  # a signal handler may call close() inside close()
        self._queue = _SnapshotQueue(maxsize=max_pending)
        self._shared = _Shared(on_written)
        self._batch: _Batch | None = None  # the batch statistics-only records are appended to, once queued
        self._thread = threading.Thread(target=_worker, args=(self._queue, self._shared), daemon=True,
                                        name=f"upd-writer {os.path.basename(self.path)}")
        self._thread.start()
        self._finalizer = weakref.finalize(self, _release, self._queue, self._thread, self._shared)
        self._finalizer.atexit = False  # exit is upd.lifetime's job: it drains and joins
        lifetime.writers.add(self)
        try:
            self._call(_open_writer, self._shared, args, kwargs)
        except BaseException:
            self._shutdown()
            raise

    # -- what the training thread sees ---------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Records queued and not yet taken by the writer thread (at most max_pending)."""
        with self._queue.mutex:
            return self._queue.records

    @property
    def records_written(self) -> int:
        return self._shared.records_written

    @property
    def bytes_written(self) -> int:
        """Bytes of tensor values (as stored: after dtype=, before compression) and statistics written so far."""
        return self._shared.bytes_written

    @property
    def write_seconds(self) -> float:
        """Wall time the writer thread spent in ``RunWriter.write``: bytes_written / write_seconds is the writer's
        sustained throughput."""
        return self._shared.write_seconds

    @property
    def error(self) -> BaseException | None:
        """The first exception raised on the writer thread, if any."""
        return self._shared.error

    @property
    def closed(self) -> bool:
        return self._closed

    def _raise_if_failed(self) -> None:
        shared = self._shared
        if shared.error is not None:
            shared.reported = True
            raise shared.error

    def _check_open(self, what: str) -> None:
        if self._closed or self._shared.stopped:
            raise ValueError(f"{what} on a closed AsyncRunWriter ({self.path})")

    def _put(self, item, count_blocked: bool = False) -> bool:
        """Put an item, waiting while the queue is full; True if it had to wait. Statistics-only records after it
        start a new batch: the one before is complete."""
        if item is _STOP or item[0] != _HOLD:
            self._batch = None
        try:
            self._queue.put_nowait(item)
            return False
        except queue.Full:
            pass
        start = time.perf_counter()
        try:
            while True:
                try:
                    self._queue.put(item, timeout=_POLL_SECONDS)
                    return True
                except queue.Full:
                    if not self._thread.is_alive():
                        raise RuntimeError(f"the writer thread for {self.path} is gone") from None
        finally:
            if count_blocked:
                self.blocked_seconds += time.perf_counter() - start

    def _call(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on the writer thread, after everything queued before it; return its result."""
        self._raise_if_failed()
        self._check_open("a call")
        future: Future = Future()
        self._put((_CALL, functools.partial(fn, *args, **kwargs), future))
        try:
            return future.result()
        except BaseException as exc:
            if exc is self._shared.error:
                self._shared.reported = True
            raise

    # -- the RunWriter interface ---------------------------------------------------------------------------------
    def write(self, rec: Record) -> None:
        """Queue one record; blocks while max_pending records are already queued. Raises the writer thread's first
        error, if there was one; the record is then not written."""
        self._raise_if_failed()
        self._check_open("write()")
        if rec.full and self._before_full_write is not None:
            self._before_full_write()
        if _holdable(rec):
            batch = self._batch
            if batch is not None:
                with self._shared.batch_lock:
                    appended = batch.open and not batch.full()
                    if appended:
                        batch.rows.append(rec)
                        batch.cells += len(rec.stats)
                if appended:
                    if batch.full():  # the writer thread writes it now, not at its deadline
                        self._put((_BATCH_FULL, batch, None))
                    return
            item = (_HOLD, _Batch(rec), None)
        else:
            item = (_WRITE, rec, None)
        waited = self._put(item, count_blocked=True)
        if item[0] == _HOLD:
            self._batch = item[1]  # queued: the next rows join it
        if waited:
            self._raise_if_failed()  # the writer failed while we waited: say so now rather than a step later

    def add_dump(self, info: dict) -> None:
        """Queue a flight-recorder dump entry after the records queued before it. Called during training, so it
        does not wait: its error, if any, surfaces like a record's."""
        self._raise_if_failed()
        self._check_open("add_dump()")
        self._put((_CALL, functools.partial(_writer_method, self._shared, "add_dump", info), None))

    def add_events(self, events: list[dict]) -> None:
        """Queue live alerts for the events table (``RunWriter.add_events``) after the records queued before it,
        without waiting, like ``add_dump``. Code on the writer thread itself appends through ``events_writer()``."""
        self._raise_if_failed()
        self._check_open("add_events()")
        self._put((_CALL, functools.partial(_writer_method, self._shared, "add_events", events), None))

    def events_writer(self) -> Callable[[list], None]:
        """A function that appends live alerts to the run's events table (``RunWriter.add_events``) at once, for
        code that runs on the writer thread itself (an ``on_written`` hook, a ``run_later`` function): the entries
        follow the records that made them. It holds the thread's shared state, never this writer."""
        return functools.partial(_writer_method, self._shared, "add_events")

    def run_later(self, fn) -> None:
        """Queue ``fn()`` to run on the writer thread after everything queued before it, without waiting for it
        (but for queue space, like ``write``). What it raises is warned about and is never the file's error."""
        self._raise_if_failed()
        self._check_open("run_later()")
        self._put((_CALL, functools.partial(_run_quietly, fn), None), count_blocked=True)

    # Everything else runs on the writer thread too, after what is queued, and returns its result (or raises its
    # error) to the caller. These are setup/teardown calls, so waiting costs nothing and errors show at the call.
    def add_optimizer(self, index: int, meta: dict) -> None:
        self._call(_writer_method, self._shared, "add_optimizer", index, meta)

    def set_attr(self, name: str, value) -> None:
        self._call(_writer_method, self._shared, "set_attr", name, value)

    def optimizer_meta(self, index: int):
        return self._call(_writer_method, self._shared, "optimizer_meta", index)

    def last_step(self, index: int):
        return self._call(_writer_method, self._shared, "last_step", index)

    def sync(self) -> None:
        """Wait until everything queued so far is written (held statistics rows too) and its on_written hook ran."""
        self._call(lambda: None)

    def truncate_from(self, index: int, step: int) -> dict:
        return self._call(_writer_method, self._shared, "truncate_from", index, step)

    def _shutdown(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer.detach()
            lifetime.writers.discard(self)
            if self._thread.is_alive():
                self._put(_STOP)  # after every queued record: this drains the queue
                self._thread.join()

    def abort(self) -> None:
        """Close after a failure elsewhere (the recorder's ``_fail``); never raises. Records already handed to
        ``write()`` are still written if the writer is healthy (the synchronous writer had written them too); after
        a writer error nothing more is written and the file is closed without a flush."""
        try:
            self._shutdown()
        except BaseException:
            pass

    def close(self) -> None:
        """Write everything queued, close the file and end the thread. Safe to call twice. Raises the writer
        thread's first error if no call has raised it yet. In a forked child (not the process that opened it) it
        does nothing: the thread is the parent's, and so is the file."""
        if not lifetime.owned_here(self):
            return
        self._shutdown()
        shared = self._shared
        if shared.error is not None and not shared.reported:
            shared.reported = True
            raise shared.error

    def __enter__(self) -> "AsyncRunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"open, {self.pending} pending"
        return f"<upd AsyncRunWriter {self.path!r} {state}, {self.records_written} records written>"
