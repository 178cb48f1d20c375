"""AsyncRunWriter: HDF5 writes on one background thread behind a bounded queue, errors surfaced, nothing lost."""
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import h5py
import numpy as np
import pytest
import torch

import upd
from upd.runfile import schema
import upd.recorder.recorder as recorder_module
from upd.runfile.async_writer import AsyncRunWriter
from upd.recorder.recorder import RecorderWarning
from upd.runfile.record import ParamSnapshot, Record
from upd.runfile.writer import RunWriter

from tests.harness.training import MLP, record_run, train_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRITER_OPTIONS = dict(overwrite=False, storage_dtype="keep", compression=None)


def writer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("upd-writer")]


@pytest.fixture(autouse=True)
def no_thread_leak():
    before = set(writer_threads())
    yield
    deadline = time.monotonic() + 5
    while set(writer_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(writer_threads()) <= before


def adam_records(count, seed=0):
    """Real snapshots: an MLP's parameters, gradients and Adam state around `count` real steps."""
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    records = []
    for step in range(count):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))
        opt.zero_grad()
        loss.backward()
        snaps = []
        for i, (name, p) in enumerate(model.named_parameters()):
            snaps.append(ParamSnapshot(name=name, group=0, index_in_group=i, param=p.detach().clone(),
                                       grad=p.grad.clone(),
                                       state={k: v.clone() for k, v in opt.state.get(p, {}).items()}))
        opt.step()
        for snap, p in zip(snaps, model.parameters()):
            snap.param_after = p.detach().clone()
        records.append(Record(optimizer=0, step=step, backward_pass=step + 1, wall_time=1000.0 + step,
                              hparams=[{"lr": 1e-2, "betas": [0.9, 0.999]}], params=snaps))
    return records


def write_all(writer, records):
    writer.add_optimizer(0, {"class": "torch.optim.Adam"})
    writer.set_attr("note", {"written": len(records)})
    for rec in records:
        writer.write(rec)
    writer.close()


def file_contents(path):
    """Every dataset (committed rows) and attribute of a run file, for comparing two files exactly."""
    out = {}
    with h5py.File(path, "r") as f:
        out["/"] = {k: v for k, v in f.attrs.items() if k not in ("meta", "resumes")}  # times, argv

        def visit(name, obj):
            out[name + "@attrs"] = dict(obj.attrs)
            if isinstance(obj, h5py.Dataset) and not name.endswith("wall_time"):
                out[name] = obj[()]
        f.visititems(visit)
    return out


def assert_same_contents(a, b, skip=()):
    ca, cb = file_contents(a), file_contents(b)
    for key in skip:
        ca.pop(key), cb.pop(key)
    assert ca.keys() == cb.keys()
    for key in ca:
        if isinstance(ca[key], np.ndarray):
            np.testing.assert_array_equal(ca[key], cb[key], err_msg=key)
            assert ca[key].dtype == cb[key].dtype, key
        else:
            assert ca[key] == cb[key], key


def slow_writes(monkeypatch, seconds):
    original = RunWriter.write

    def slow_write(self, rec):
        time.sleep(seconds)
        original(self, rec)
    monkeypatch.setattr(RunWriter, "write", slow_write)


class DiskFull(OSError):
    pass


def failing_writes(monkeypatch, fail_at):
    """RunWriter.write raises at its fail_at-th call (1-based); returns the exception object."""
    monkeypatch.setattr("upd.runfile.async_writer.FULL_BATCH", 1)  # the failing call is one record
    original = RunWriter.write
    calls = []
    error = DiskFull("no space left on device (injected)")

    def write(self, rec):
        calls.append(rec.step)
        if len(calls) == fail_at:
            raise error
        original(self, rec)
    monkeypatch.setattr(RunWriter, "write", write)
    return error


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# -- what is written ---------------------------------------------------------------------------------------------
def test_async_file_equals_sync_file(tmp_path):
    records = adam_records(5)
    sync_path, async_path = str(tmp_path / "sync.h5"), str(tmp_path / "async.h5")
    meta = {"run": "x"}
    write_all(RunWriter(sync_path, meta, **WRITER_OPTIONS), records)
    writer = AsyncRunWriter(async_path, meta, **WRITER_OPTIONS)
    write_all(writer, records)
    assert_same_contents(sync_path, async_path)
    assert writer.records_written == 5 and writer.pending == 0
    nbytes = sum(t.numel() * t.element_size() for rec in records for s in rec.params
                 for t in (s.param, s.grad, s.param_after, *s.state.values()))
    assert writer.bytes_written == nbytes
    with upd.open_run(async_path) as run:
        assert run.optimizers[0].num_records == 5
        w = run.param("fc1.weight")
        for row, rec in enumerate(records):
            snap = rec.params[0]
            assert torch.equal(w.read("param", row), snap.param)
            assert torch.equal(w.read("grad", row), snap.grad)
            assert torch.equal(w.read("param_after", row), snap.param_after)


def test_bytes_written_counts_storage_dtype(tmp_path):
    records = adam_records(2)
    writer = AsyncRunWriter(str(tmp_path / "half.h5"), {}, overwrite=False, storage_dtype="float16",
                            compression=None)
    write_all(writer, records)
    on_disk = 0  # bytes of the rows actually written (a state dataset has empty rows before its key appeared)
    with h5py.File(str(tmp_path / "half.h5"), "r") as f:
        for grp in f[schema.PARAMS_GROUP.path(k=0)].values():
            on_disk += sum(grp[kind].nbytes for kind in ("param", "grad", "param_after"))
            present = grp["state_present"][()]
            for i, key in enumerate(json.loads(grp["state"].attrs["keys"])):
                ds = grp["state"][key]
                on_disk += int(present[:, i].sum()) * ds.dtype.itemsize * int(np.prod(ds.shape[1:]))
    assert writer.bytes_written == on_disk
    full = sum(t.numel() * t.element_size() for rec in records for s in rec.params
               for t in (s.param, s.grad, s.param_after, *s.state.values()))
    assert writer.bytes_written < full


def use_writer(monkeypatch, kind):
    """Make the recorder write through AsyncRunWriter ("async") or the plain RunWriter ("sync"), whichever name
    the recorder constructs its writer by; returns the list of writers it creates."""
    created = []

    def make_writer(*args, max_pending=2, before_full_write=None, **kwargs):
        created.append(AsyncRunWriter(*args, max_pending=max_pending, before_full_write=before_full_write, **kwargs)
                       if kind == "async" else RunWriter(*args, **kwargs))
        return created[-1]
    for name in ("RunWriter", "AsyncRunWriter"):
        monkeypatch.setattr(recorder_module, name, make_writer, raising=False)
    return created


# every=3, stats_every=1: five steps, and one write at close of the total gradient norms logged at the statistics-only
# steps (they wait for a full record, or for close)
@pytest.mark.parametrize("options, writes", [({}, 5), ({"every": 2, "dtype": "bfloat16"}, 3),
                                             ({"every": 3, "stats_every": 1}, 6)])
def test_recorder_with_async_writer_matches_sync(tmp_path, monkeypatch, options, writes):
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    use_writer(monkeypatch, "sync")
    sync_path = record_run(str(tmp_path / "sync.h5"), make_opt, steps=5, **options)
    created = use_writer(monkeypatch, "async")
    async_path = record_run(str(tmp_path / "async.h5"), make_opt, steps=5, **options)
    assert len(created) == 1 and created[0].closed and created[0].records_written == writes
    assert_same_contents(sync_path, async_path)


def test_flight_recorder_dumps_through_async_writer(tmp_path, monkeypatch):
    def diverging(path):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with upd.record(path, model, opt, every=None, flight_recorder=3) as rec:
            train_steps(model, opt, steps=8, after_step=lambda i: i == 4 and rec.dump("test"))
        return path, rec.dumps
    use_writer(monkeypatch, "sync")
    sync_path, sync_dumps = diverging(str(tmp_path / "sync.h5"))
    created = use_writer(monkeypatch, "async")
    async_path, async_dumps = diverging(str(tmp_path / "async.h5"))
    assert async_dumps and [d["steps"] for d in async_dumps] == [d["steps"] for d in sync_dumps] == [[2, 3, 4]]
    assert created[0].records_written == 3
    with upd.open_run(async_path) as run:
        assert run.dumps()["steps"].tolist() == [[2, 3, 4]]
        assert sorted(int(s) for s in run.optimizers[0].steps) == [2, 3, 4]
    assert_same_contents(sync_path, async_path, skip=["flight_dumps"])  # the dumps' wall_time differs


def resumed_run(path):
    """4 recorded SGD steps, a 'restart' from a checkpoint, 3 more steps recorded with resume=True."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=4, seed=1)
    model2 = MLP()
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with upd.record(path, model2, opt2, resume=True, every=1):  # SGD has no step state: last_step() numbers the steps
        train_steps(model2, opt2, steps=3, seed=2)
    return path


def test_recorder_resume_through_async_writer(tmp_path, monkeypatch):
    use_writer(monkeypatch, "sync")
    sync_path = resumed_run(str(tmp_path / "sync.h5"))
    created = use_writer(monkeypatch, "async")
    async_path = resumed_run(str(tmp_path / "async.h5"))
    assert len(created) == 2
    assert_same_contents(sync_path, async_path)
    with upd.open_run(async_path) as run:
        assert list(run.optimizers[0].steps) == list(range(7))
    other = MLP()  # optimizer_meta() answers through the writer thread: the refusal still happens in record()
    with pytest.raises(ValueError, match="was torch.optim.SGD, now torch.optim.Adam"):
        upd.record(async_path, other, torch.optim.Adam(other.parameters()), resume=True, every=1)
    assert created[-1].closed


def test_every_hdf5_call_runs_on_the_one_writer_thread(tmp_path, monkeypatch):
    monkeypatch.setattr("upd.runfile.async_writer.FULL_BATCH", 1)  # one call per record
    threads = []
    for name in ("__init__", "add_optimizer", "set_attr", "write", "last_step", "close"):
        def spy(self, *args, _original=getattr(RunWriter, name), **kwargs):
            threads.append(threading.current_thread())
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(RunWriter, name, spy)
    writer = AsyncRunWriter(str(tmp_path / "one.h5"), {}, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    for rec in adam_records(2):
        writer.write(rec)
    assert writer.last_step(0) == 1
    writer.close()
    assert len(threads) == 6 and set(threads) == {writer._thread}


def test_every_public_run_writer_method_has_its_async_counterpart():
    """The recorder calls either writer by the same names: a method added to RunWriter needs one here too."""
    public = {name for name in dir(RunWriter) if not name.startswith("_")}
    assert public <= {name for name in dir(AsyncRunWriter) if not name.startswith("_")}


# -- the bound ---------------------------------------------------------------------------------------------------
def test_queue_is_bounded_and_write_blocks(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.03)
    records = adam_records(8)
    writer = AsyncRunWriter(str(tmp_path / "slow.h5"), {}, max_pending=2, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    seen, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            seen.append(writer.pending)
            time.sleep(0.001)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        durations = []
        for rec in records:
            start = time.perf_counter()
            writer.write(rec)
            durations.append(time.perf_counter() - start)
            seen.append(writer.pending)
    finally:
        stop.set()
        sampler.join()
    assert max(seen) == 2  # reached, never exceeded
    assert writer.blocked_seconds > 0
    assert max(durations) > 0.005  # write() itself waited for the writer thread
    writer.close()
    assert writer.records_written == len(records) and writer.pending == 0
    with upd.open_run(str(tmp_path / "slow.h5")) as run:
        assert run.optimizers[0].num_records == len(records)


def gated_writes(monkeypatch, fail=False):
    """RunWriter.write waits until the returned event is set (then raises DiskFull when fail=True)."""
    original, gate = RunWriter.write, threading.Event()

    def write(self, rec):
        assert gate.wait(10)
        if fail:
            raise DiskFull("injected")
        original(self, rec)
    monkeypatch.setattr(RunWriter, "write", write)
    return gate


def fill_queue(writer, records):
    """One record in the writer thread's hands (held at the gate), max_pending more queued."""
    writer.write(records[0])
    wait_for(lambda: writer.pending == 0)  # taken by the thread, which now waits at the gate
    for rec in records[1:1 + writer.max_pending]:
        writer.write(rec)
    assert writer.pending == writer.max_pending and writer.blocked_seconds == 0.0


def test_write_blocks_exactly_while_the_queue_is_full(tmp_path, monkeypatch):
    gate = gated_writes(monkeypatch)
    records = adam_records(5)
    writer = AsyncRunWriter(str(tmp_path / "gate.h5"), {}, max_pending=2, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    fill_queue(writer, records)
    assert writer.records_written == 0
    start = time.perf_counter()
    threading.Timer(0.3, gate.set).start()
    writer.write(records[3])  # blocks until the gate opens and the thread takes the next record
    waited = time.perf_counter() - start
    assert waited >= 0.3 and 0.1 < writer.blocked_seconds <= waited
    assert writer.pending <= 2
    writer.write(records[4])
    writer.close()
    assert writer.records_written == 5
    with upd.open_run(str(tmp_path / "gate.h5")) as run:
        assert run.optimizers[0].num_records == 5


def test_error_while_write_waits_is_raised_by_that_write(tmp_path, monkeypatch):
    gate = gated_writes(monkeypatch, fail=True)
    records = adam_records(4)
    writer = AsyncRunWriter(str(tmp_path / "gate_fail.h5"), {}, max_pending=2, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    fill_queue(writer, records)
    threading.Timer(0.1, gate.set).start()
    with pytest.raises(DiskFull):
        writer.write(records[3])
    assert writer.blocked_seconds > 0
    writer.close()
    assert writer.records_written == 0
    with upd.open_run(str(tmp_path / "gate_fail.h5")) as run:
        assert run.optimizers[0].num_records == 0


def test_no_blocking_when_the_writer_keeps_up(tmp_path, monkeypatch):
    """Training that writes bursts of max_pending records and leaves the writer time to catch up between them never
    waits, however many records it writes in all; the same loop against a writer slower than training does wait,
    so the zero is measured, not built in."""
    max_pending, step_seconds = 2, 0.1
    records = adam_records(3 * max_pending)  # more than the queue and the record in the thread's hands together

    def blocked_seconds(name, rest_of_step):
        writer = AsyncRunWriter(str(tmp_path / name), {}, max_pending=max_pending, **WRITER_OPTIONS)
        writer.add_optimizer(0, {})  # waits for the writer thread: the queue is empty after it
        for first in range(0, len(records), max_pending):
            for rec in records[first:first + max_pending]:  # a burst that fits an empty queue, never more
                writer.write(rec)
            rest_of_step(writer, first + max_pending)
        writer.close()
        assert writer.records_written == len(records)
        return writer.blocked_seconds

    def until_written(writer, count):
        # A writer that keeps up has taken the burst by the next step; waiting for exactly that (not for a fixed
        # time) keeps the test independent of how loaded the machine is.
        deadline = time.monotonic() + 60
        while writer.records_written < count and time.monotonic() < deadline:
            time.sleep(0.005)

    assert blocked_seconds("keeps_up.h5", until_written) == 0.0
    slow_writes(monkeypatch, 2 * step_seconds)  # each record now takes two training steps to write
    assert blocked_seconds("falls_behind.h5", lambda writer, count: time.sleep(step_seconds)) > step_seconds / 2


def test_max_pending_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_pending"):
        AsyncRunWriter(str(tmp_path / "x.h5"), {}, max_pending=0, **WRITER_OPTIONS)


# -- close -------------------------------------------------------------------------------------------------------
def test_close_drains_everything_and_twice_is_fine(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.01)
    path = str(tmp_path / "drain.h5")
    records = adam_records(6)
    writer = AsyncRunWriter(path, {}, max_pending=3, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    for rec in records:
        writer.write(rec)
    writer.close()
    assert writer.pending == 0 and writer.records_written == 6 and not writer_threads()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write(records[0])
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.num_records == 6
        b = run.param("fc2.bias")
        for row, rec in enumerate(records):
            assert torch.equal(b.read("param_after", row), rec.params[3].param_after)
            assert torch.equal(b.read("state/exp_avg_sq", row), rec.params[3].state["exp_avg_sq"]) if row else True


def test_open_errors_surface_in_the_constructor(tmp_path):
    path = str(tmp_path / "exists.h5")
    RunWriter(path, {}, **WRITER_OPTIONS).close()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        AsyncRunWriter(path, {}, **WRITER_OPTIONS)


def test_add_optimizer_errors_surface_at_the_call(tmp_path, monkeypatch):
    error = DiskFull("injected")

    def add_optimizer(self, index, meta):
        raise error
    monkeypatch.setattr(RunWriter, "add_optimizer", add_optimizer)
    writer = AsyncRunWriter(str(tmp_path / "add.h5"), {}, **WRITER_OPTIONS)
    with pytest.raises(DiskFull) as raised:
        writer.add_optimizer(0, {})
    assert raised.value is error
    with pytest.raises(DiskFull):
        writer.write(adam_records(1)[0])  # the writer failed: nothing more is written
    writer.close()  # already reported: not raised again


# -- errors on the writer thread ---------------------------------------------------------------------------------
def test_writer_error_surfaces_on_next_write_and_stops_writing(tmp_path, monkeypatch):
    error = failing_writes(monkeypatch, fail_at=2)
    path = str(tmp_path / "fail.h5")
    records = adam_records(4)
    writer = AsyncRunWriter(path, {}, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    writer.write(records[0])
    writer.write(records[1])  # fails on the thread
    wait_for(lambda: writer.error is not None)
    with pytest.raises(DiskFull) as raised:
        writer.write(records[2])
    assert raised.value is error  # the very exception, not a wrapper
    with pytest.raises(DiskFull):
        writer.write(records[3])  # still failed; nothing more is written
    writer.close()  # already reported: close only closes
    writer.close()
    assert writer.records_written == 1
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 1


def test_writer_error_surfaces_on_close(tmp_path, monkeypatch):
    error = failing_writes(monkeypatch, fail_at=2)
    path = str(tmp_path / "fail_close.h5")
    writer = AsyncRunWriter(path, {}, max_pending=4, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    for rec in adam_records(3):
        writer.write(rec)  # the failure happens behind these calls
    with pytest.raises(DiskFull) as raised:
        writer.close()
    assert raised.value is error
    writer.close()  # reported once; the second close is quiet
    assert writer.records_written == 1
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 1


def test_abort_never_raises(tmp_path, monkeypatch):
    records = adam_records(3)
    healthy = AsyncRunWriter(str(tmp_path / "healthy.h5"), {}, **WRITER_OPTIONS)
    healthy.add_optimizer(0, {})
    for rec in records:
        healthy.write(rec)
    healthy.abort()  # the recorder failed elsewhere: what it handed over is still written
    assert healthy.closed and healthy.records_written == 3
    failing_writes(monkeypatch, fail_at=1)
    broken = AsyncRunWriter(str(tmp_path / "broken.h5"), {}, **WRITER_OPTIONS)
    broken.add_optimizer(0, {})
    broken.write(records[0])
    wait_for(lambda: broken.error is not None)
    broken.abort()
    broken.abort()
    assert broken.closed and broken.records_written == 0
    with upd.open_run(str(tmp_path / "broken.h5")) as run:
        assert run.optimizers[0].num_records == 0


def test_recorder_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    error = failing_writes(monkeypatch, fail_at=2)
    use_writer(monkeypatch, "async")
    path = str(tmp_path / "rec_fail.h5")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RecorderWarning, match="no space left") as warned:
        with upd.record(path, model, opt, every=1) as rec:
            train_steps(model, opt, steps=2)
            wait_for(lambda: rec._writer.error is not None)
            train_steps(model, opt, steps=3)  # the next step's write() raises: the recorder stops
    assert len([w for w in warned if issubclass(w.category, RecorderWarning)]) == 1
    assert rec.error is error and not rec.active
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 1


# -- lifetime ----------------------------------------------------------------------------------------------------
def test_garbage_collected_writer_finishes_and_closes(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.01)
    path = str(tmp_path / "gc.h5")
    writer = AsyncRunWriter(path, {}, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    for rec in adam_records(3):
        writer.write(rec)
    thread = writer._thread
    del writer
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 3


@pytest.mark.slow
def test_exit_without_close_drains_and_does_not_hang(tmp_path):
    path = str(tmp_path / "exit.h5")
    script = textwrap.dedent(f"""
        import time, torch
        from upd.runfile.record import ParamSnapshot, Record
        from upd.runfile.writer import RunWriter
        from upd.runfile.async_writer import AsyncRunWriter
        original = RunWriter.write
        def slow(self, rec):
            time.sleep(0.05)
            original(self, rec)
        RunWriter.write = slow
        w = AsyncRunWriter({path!r}, {{}}, overwrite=False, storage_dtype="keep", compression=None)
        w.add_optimizer(0, {{}})
        for step in range(4):
            t = torch.full((3, 2), float(step))
            w.write(Record(optimizer=0, step=step, backward_pass=step, wall_time=0.0, hparams=[{{"lr": 0.1}}],
                           params=[ParamSnapshot("w", 0, 0, param=t, grad=t, param_after=t + 1)]))
        assert w.pending > 0  # records still queued when the interpreter starts to exit
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 4
        assert torch.equal(run.param("w").read("param_after", 3), torch.full((3, 2), 4.0))
