"""Statistics-only records are committed in batches by the writer thread: held at most HOLD_ROWS records or
HOLD_SECONDS, written before anything queued after them, and never lost by close()."""
import dataclasses
import time

import h5py
import numpy as np
import pytest
import torch

import upd
from upd.runfile import async_writer, schema
from upd.runfile.async_writer import AsyncRunWriter
from upd.runfile.stats_table import StatsRows
from upd.runfile.writer import RunWriter

from tests.harness.training import MLP, train_steps

WRITER_OPTIONS = dict(overwrite=True, storage_dtype="keep", compression=None)


def stats_records(steps: int) -> list:
    """Real statistics-only records: a recorder's, captured instead of written."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    captured = []
    rec = upd.record("unused.h5", model, opt, every=None, stats_every=1, overwrite=True)
    real_write = rec._writer.write
    rec._writer.write = captured.append
    train_steps(model, opt, steps=steps)
    rec._writer.write = real_write
    rec.close()
    assert len(captured) == steps and all(not r.full and r.stats for r in captured)
    return captured


def committed_steps(path) -> list:
    with h5py.File(path, "r") as f:
        return f[schema.STATS_TABLE.at(schema.STEP, k=0)][()].tolist()


def test_held_records_are_committed_together_at_close_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records = stats_records(5)
    path = str(tmp_path / "async.h5")
    writer = AsyncRunWriter(path, {}, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    calls = []
    real = RunWriter.write
    monkeypatch.setattr(RunWriter, "write", lambda self, rec: (calls.append(rec), real(self, rec)))
    for rec in records:
        writer.write(rec)
    time.sleep(0.2)
    assert writer.records_written == 0 and not calls  # held: nothing written yet
    writer.close()
    assert writer.records_written == 5
    assert len(calls) == 1 and [r.step for r in calls[0]] == [0, 1, 2, 3, 4]  # one write, one commit
    # The same table as writing them one by one.
    sync_path = str(tmp_path / "sync.h5")
    sync = RunWriter(sync_path, {}, **WRITER_OPTIONS)
    sync.add_optimizer(0, {})
    for rec in records:
        real(sync, rec)
    sync.close()
    assert committed_steps(path) == committed_steps(sync_path) == [0, 1, 2, 3, 4]
    with upd.open_run(path) as a, upd.open_run(sync_path) as b:
        left, right = a.stats(), b.stats()
    assert len(left) == 5 * 4 and left.equals(right)


def test_held_records_are_written_before_a_full_record_and_after_hold_seconds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(async_writer, "HOLD_SECONDS", 0.3)
    records = stats_records(4)
    path = str(tmp_path / "run.h5")
    writer = AsyncRunWriter(path, {}, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    writer.write(records[0])
    writer.write(records[1])
    deadline = time.monotonic() + 10
    while writer.records_written < 2 and time.monotonic() < deadline:  # nothing else arrives: the time limit
        time.sleep(0.02)
    assert writer.records_written == 2
    writer.write(records[2])
    writer.set_attr("note", "a call after a held record")  # waits for its result: the held record goes first
    assert writer.records_written == 3
    writer.write(records[3])
    writer.close()
    assert committed_steps(path) == [0, 1, 2, 3]


def test_at_most_hold_rows_are_held(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(async_writer, "HOLD_ROWS", 3)
    monkeypatch.setattr(async_writer, "HOLD_SECONDS", 60.0)
    records = stats_records(7)
    writer = AsyncRunWriter(str(tmp_path / "run.h5"), {}, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    for rec in records:
        writer.write(rec)
    deadline = time.monotonic() + 10
    while writer.records_written < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert writer.records_written == 6  # two batches of 3; the seventh waits for more, or for close
    writer.close()
    assert writer.records_written == 7
    assert committed_steps(writer.path) == list(range(7))


def test_a_recorded_run_longer_than_a_batch_keeps_every_row(tmp_path, monkeypatch):
    """Through the recorder: every statistics row of a real run (two batches and a rest), with the lean set's
    values."""
    monkeypatch.setattr(async_writer, "HOLD_ROWS", 32)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1):
        train_steps(model, opt, steps=70)  # more than HOLD_ROWS
    with upd.open_run(path) as run:
        table = run.stats()
    assert sorted(table["step"].unique()) == list(range(70))
    assert np.isfinite(table["update_to_data"]).all() and (table["update_norm"] > 0).all()


def live_stats_steps(path) -> list:
    """The statistics steps a live reader sees in the run now."""
    with upd.open_run(path) as run:
        table = run.stats()
    return sorted(table["step"].unique().tolist())


def test_a_batch_wakes_the_writer_thread_once_and_is_committed_by_its_deadline_without_more_steps(tmp_path,
                                                                                                    monkeypatch):
    """Rows are held on the training thread: the first row of a batch goes through the queue, the others are
    appended to it without waking the writer thread. With no further step the batch is still committed once its
    first row has waited HOLD_SECONDS (a live reader sees it), and close() commits the rows held after it."""
    monkeypatch.setattr(async_writer, "HOLD_SECONDS", 0.8)
    queued = []
    real_put = async_writer._SnapshotQueue._put
    monkeypatch.setattr(async_writer._SnapshotQueue, "_put", lambda self, item: (queued.append(item), real_put(self, item)))
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    rec = upd.record(path, model, opt, every=None, stats_every=1)
    rec._backward_ended_eagerly  # made at the first backward pass otherwise: its import would outlast the window
    queued.clear()  # setup's calls
    started = time.monotonic()
    train_steps(model, opt, steps=4)
    assert time.monotonic() - started < 0.6, "the steps outlasted the window: the test cannot tell"
    assert len(queued) == 1 and queued[0][0] == async_writer._HOLD and len(queued[0][1].rows) == 4
    assert rec._writer.records_written == 0  # held: nothing committed yet
    deadline = time.monotonic() + 10
    while rec._writer.records_written < 4 and time.monotonic() < deadline:  # no step: the deadline alone commits
        time.sleep(0.02)
    assert rec._writer.records_written == 4 and time.monotonic() - started >= 0.8
    assert live_stats_steps(path) == [0, 1, 2, 3]
    train_steps(model, opt, steps=2, seed=1)  # a new batch, held until close
    assert len(queued) == 2 and rec._writer.records_written == 4
    rec.close()
    assert committed_steps(path) == list(range(6))


def test_abort_keeps_the_committed_rows_and_writes_the_held_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(async_writer, "HOLD_SECONDS", 0.3)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    rec = upd.record(path, model, opt, every=None, stats_every=1)
    train_steps(model, opt, steps=3)
    deadline = time.monotonic() + 10
    while rec._writer.records_written < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec._writer.records_written == 3
    train_steps(model, opt, steps=2, seed=1)
    with pytest.warns(upd.RecorderWarning, match="simulated"):
        rec._fail(RuntimeError("simulated"))  # a recorder error: the writer is aborted, and still writes what it
    assert committed_steps(path) == list(range(5))  # was handed while healthy
    rec.close()
    assert committed_steps(path) == list(range(5))


def test_a_statistics_table_is_written_as_its_rows_would_be(tmp_path, monkeypatch):
    """The lean set's StatsRows (a table the writer copies as it is) and the same rows as {name: {column: value}}
    give the same file: after the full set's first row (more columns: the lean ones land at positions, not in a
    slice), and when a step holds fewer parameters, in another order."""
    monkeypatch.chdir(tmp_path)
    records = stats_records(4)
    assert all(isinstance(r.stats, StatsRows) for r in records)
    assert len(records[0].stats.columns) > len(records[1].stats.columns)  # the full set's row: more columns
    names = list(records[1].stats)
    partial = StatsRows(names[::-2], records[2].stats.columns, records[2].stats.table[::-2])  # reversed, some left out
    records[2] = dataclasses.replace(records[2], stats=partial)
    as_dicts = [dataclasses.replace(r, stats={name: dict(values) for name, values in r.stats.items()})
                for r in records]
    assert as_dicts[2].stats[names[-1]] == partial[names[-1]] and names[-2] not in as_dicts[2].stats
    paths = []
    for label, recs in (("table", records), ("dicts", as_dicts)):
        paths.append(str(tmp_path / f"{label}.h5"))
        writer = RunWriter(paths[-1], {}, **WRITER_OPTIONS)
        writer.add_optimizer(0, {})
        writer.write(recs[:3])
        writer.write(recs[3])
        writer.close()
    with upd.open_run(paths[0]) as a, upd.open_run(paths[1]) as b:
        left, right = a.stats(), b.stats()
    assert len(left) == 3 * len(names) + len(partial) and left.equals(right)
    row = left[(left["step"] == 2) & (left["param"] == names[-1])].iloc[0]
    assert row["update_to_data"] == np.float32(partial[names[-1]]["update_to_data"])
    corrupted = StatsRows(partial.names, partial.columns, partial.table[::-1])  # rows in the wrong order: caught
    writer = RunWriter(paths[0], {}, **WRITER_OPTIONS)
    writer.add_optimizer(0, {})
    writer.write(dataclasses.replace(records[2], stats=corrupted))
    writer.close()
    with upd.open_run(paths[0]) as a:
        assert not a.stats().equals(right[right["step"] == 2].reset_index(drop=True))
