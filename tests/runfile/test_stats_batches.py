"""Statistics-only records are committed in batches by the writer thread: held at most HOLD_ROWS records or
HOLD_SECONDS, written before anything queued after them, and never lost by close()."""
import time

import h5py
import numpy as np
import torch

import upd
from upd.runfile import async_writer, schema
from upd.runfile.async_writer import AsyncRunWriter
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


def test_a_recorded_run_longer_than_a_batch_keeps_every_row(tmp_path):
    """Through the recorder: every statistics row of a real run (two batches and a rest), with the lean set's
    values."""
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
