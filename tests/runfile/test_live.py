"""Reading a run while it is being written: from another process, from the training process itself, and the
failures that must be reported instead of read (a writer stuck inside a record, a file that changes during the copy).
`python -m benchmarks.live_read` runs the cross-process check at scale."""
import os
import time

import pytest
import torch
from click.testing import CliRunner

import upd
from upd.runfile import livelock
from upd.cli.main import main as cli
from upd.runfile.writer import RunWriter

from tests.harness import live as live_read
from tests.harness.training import MLP

pytestmark = pytest.mark.skipif(not livelock.supported(), reason="no open-file-description locks on this platform")


@pytest.mark.slow
def test_reads_while_another_process_writes_then_after_sigkill(tmp_path):
    # The reads start once a record is acknowledged: on a loaded machine the child's first step can outlast them all.
    # 100 steps (at least 2 s of writing, while the first read comes 0.1-0.4 s after the first record): the reads
    # still see the run grow, and the verify of the final read (every record) stays short.
    reads, final = live_read.run_live_reads(reads=6, seed=3, width=32, pause=0.02, steps=100, low=0.1, high=0.4,
                                            workdir=str(tmp_path), after_records=1)
    for r in reads:
        assert live_read.ok(r, live=True), r
    assert reads[-1]["records"] > max(reads[0]["records"], 0)  # each read shows the records written so far
    assert any(r["verify"] == 0 for r in reads)
    assert live_read.ok(final, live=False), final  # the killed writer's lock is gone with it


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()


def test_training_process_reads_its_own_run(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    seen = []
    with upd.record(path, model, opt, stats_every=1, every=1) as rec:
        for _ in range(5):
            _train(model, opt, 3)
            with upd.open_run(path) as run:
                assert run.live
                seen.append(run.optimizers[0].num_records)
                assert list(run.optimizers[0].steps) == list(range(seen[-1]))
                assert run.describe()["live"] is True
            report = upd.verify(path)
            assert report.live and report.matched > 0 and report.exit_code == 0
    assert seen == sorted(seen) and seen[-1] >= 10
    with upd.open_run(path) as run:
        assert not run.live and run.optimizers[0].num_records == 15
    assert not upd.verify(path).live


def test_cli_on_a_live_run(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = str(tmp_path / "run.h5")
    runner = CliRunner()
    with upd.record(path, model, opt, every=1):
        _train(model, opt, 6)
        rec_deadline = time.monotonic() + 30
        while _records(path) < 6 and time.monotonic() < rec_deadline:  # the writer thread may still be catching up
            time.sleep(0.01)
        info = runner.invoke(cli, ["info", path])
        assert info.exit_code == 0 and "being written" in info.output, info.output
        analyzed = runner.invoke(cli, ["analyze", path, "--no-plots"])
        assert analyzed.exit_code == 0 and "being written; analyzing the records committed so far" in analyzed.output
        verified = runner.invoke(cli, ["verify", path, "--json"])
        assert verified.exit_code == 0, verified.output
        assert '"live": true' in verified.output
    info = runner.invoke(cli, ["info", path])
    assert info.exit_code == 0 and "being written" not in info.output


def _records(path):
    with upd.open_run(path) as run:
        return run.optimizers[0].num_records


def _writer(path):
    writer = RunWriter(path, {"torch_version": torch.__version__, "created_unix": 0, "options": {}},
                       overwrite=False, storage_dtype="keep", compression=None)
    writer.add_optimizer(0, {"class": "torch.optim.SGD", "defaults": {}})
    return writer


def test_a_writer_inside_a_record_is_waited_for_then_reported(tmp_path):
    path = str(tmp_path / "run.h5")
    writer = _writer(path)
    try:
        writer._locks.begin()  # the writer is between its first change and the flush that ends the record
        started = time.monotonic()
        with pytest.raises(upd.RunFileError, match="being written, and no complete copy .* stayed inside one record"):
            upd.open_run(path, live_timeout=0.3)
        assert time.monotonic() - started >= 0.3
        result = CliRunner().invoke(cli, ["info", path], env={"UPD_LIVE_TIMEOUT": "0.2"})
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and path in result.stderr and "0.2 s" in result.stderr
        writer._locks.end()
        with upd.open_run(path) as run:  # the record ended: the copy is taken at once
            assert run.live and run.optimizers[0].num_records == 0
    finally:
        writer.close()
    with upd.open_run(path) as run:
        assert not run.live


def test_a_file_that_changes_during_the_copy_is_copied_again_or_refused(tmp_path, monkeypatch):
    # A writer that does not take the lock (a platform without OFD locks, or one that gave up on a stopped reader)
    # is caught by comparing the file before and after the copy.
    path = str(tmp_path / "run.h5")
    writer = _writer(path)
    real_copy = livelock._copy
    changes = {"left": 2}

    def copy_while_writing(src, dst, size):
        real_copy(src, dst, size)
        if changes["left"]:
            changes["left"] -= 1
            with open(path, "ab") as f:  # bytes past HDF5's end of file: harmless to the run, visible to the check
                f.write(b"\0" * 16)

    monkeypatch.setattr(livelock, "_copy", copy_while_writing)
    try:
        with upd.open_run(path) as run:  # third attempt: nothing changed
            assert run.live
        assert changes["left"] == 0
        changes["left"] = 99
        with pytest.raises(upd.RunFileError, match="changed during each of 5 copies"):
            upd.open_run(path)
    finally:
        writer.close()


def test_two_writers_cannot_share_a_run(tmp_path):
    path = str(tmp_path / "run.h5")
    writer = _writer(path)
    try:
        with pytest.raises(OSError, match="being written by another recorder"):
            livelock.WriterLocks(path)
    finally:
        writer.close()
    livelock.WriterLocks(path).close()  # free again once the first one closed


def test_a_run_read_in_place_refuses_reads_once_a_recorder_resumes_it(tmp_path):
    # Opened when nobody wrote it, the run is read in place and lazily: a recorder that resumes it afterwards
    # changes metadata under the reader's cache, so the reader refuses instead of trusting what it would read.
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        _train(model, opt, 3)
    run = upd.open_run(path)
    try:
        assert not run.live
        before = run.param("fc1.weight").read("param")  # reads while nothing changed work
        with upd.record(path, model, opt, resume=True, every=1):
            _train(model, opt, 2)
            with pytest.raises(upd.RunFileError, match="changed after it was opened .* open it again"):
                run.param("fc1.weight").read("param")
        with pytest.raises(upd.RunFileError, match="changed after it was opened"):  # still refused: stale cache
            run.ratios()
    finally:
        run.close()
    with upd.open_run(path) as fresh:  # a fresh open sees all five records, the first three as they were
        assert fresh.optimizers[0].num_records == 5
        assert torch.equal(fresh.param("fc1.weight").read("param", slice(0, 3)), before)


def test_a_stopped_reader_cannot_stall_the_writer_past_its_patience(tmp_path):
    path = str(tmp_path / "run.h5")
    writer = _writer(path)
    reader_fd = os.open(path, os.O_RDONLY)
    try:
        assert livelock.lock(reader_fd, livelock.COMMIT_BYTE, exclusive=False, timeout=1)  # a copy that never ends
        writer._locks.patience = 0.3
        started = time.monotonic()
        writer.add_optimizer(1, {"class": "torch.optim.SGD", "defaults": {}})  # a change waits, then goes on
        assert 0.3 <= time.monotonic() - started < 5
        assert not writer._locks.held
    finally:
        os.close(reader_fd)
        writer.close()
    with upd.open_run(path) as run:
        assert [o.index for o in run.optimizers] == [0, 1]
