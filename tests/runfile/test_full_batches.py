"""Full records already queued behind the one being written are committed together (upd/runfile/async_writer.py,
``_write_record``): on a real recorded run every record reads back as the tensors the optimizer saw, ``upd verify``
passes, and a process killed between a batch's rows and its commit keeps every earlier record and none of the
batch, and can be resumed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import h5py
import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema
from upd.runfile.writer import RunWriter

from tests.harness.paths import REPO_ROOT as REPO

STEPS = 6


def gate_first_write(monkeypatch) -> tuple[threading.Event, list]:
    """The writer thread's first RunWriter.write waits until the gate opens, so the records after it queue up
    behind it. Returns the gate and, per call, the steps of the full records it wrote."""
    real, gate, calls = RunWriter.write, threading.Event(), []

    def write(self, rec):
        if not calls:
            assert gate.wait(60)
        calls.append([r.step for r in (rec if isinstance(rec, list) else [rec]) if r.full])
        return real(self, rec)

    monkeypatch.setattr(RunWriter, "write", write)
    return gate, calls


def test_a_record_the_writer_refuses_does_not_take_the_records_queued_before_it(tmp_path, monkeypatch):
    """A parameter that changes shape in place stops recording at its first record. Records queued before it are
    committed: only records of one layout share a commit (``_layout``), so the refused one fails alone."""
    import warnings

    from upd.runfile import async_writer

    gate, calls = gate_first_write(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.h5"
    monkeypatch.setattr(async_writer, "_SnapshotQueue", _queue_of(8))  # room for every step while the gate is shut
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = upd.record(path, model, opt, every=1)
        for step in range(4):
            if step == 3:  # the same Parameter objects, a new shape
                model[0].bias.data = torch.zeros(5)
                model[0].weight.data = torch.zeros(5, 6)
            opt.zero_grad()
            model(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
        gate.set()
        rec.close()
    assert rec.error is not None and sum("recording" in str(w.message) for w in caught) == 1
    # Steps queued behind the gate were committed together (with step 0 too when the writer thread took it late);
    # step 3, refused, on its own.
    assert calls[-1] == [3] and sorted(sum(calls[:-1], [])) == [0, 1, 2], calls
    assert max(len(call) for call in calls[:-1]) >= 2, calls
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].steps) == [0, 1, 2]
    assert upd.verify(path).exit_code == 0


def _queue_of(size: int):
    from upd.runfile import async_writer

    class Queue(async_writer._SnapshotQueue):
        def __init__(self, maxsize):
            super().__init__(maxsize=size)
    return Queue


def test_queued_full_records_are_committed_together_and_read_back_exactly(tmp_path, monkeypatch):
    path = tmp_path / "batched.h5"
    gate, calls = gate_first_write(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []  # per step: {parameter: (before, grad, after, exp_avg before the step)}
    opt.register_step_pre_hook(lambda o, a, k: seen.append(
        {p: (p.detach().clone(), p.grad.clone(), None, o.state[p]["exp_avg"].clone() if o.state[p] else None)
         for p in model.parameters()}))
    opt.register_step_post_hook(lambda o, a, k: seen[-1].update(
        {p: (*seen[-1][p][:2], p.detach().clone(), seen[-1][p][3]) for p in model.parameters()}))
    g = torch.Generator().manual_seed(1)
    with upd.record(path, model, opt, every=1):
        for step in range(STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(16, 8, generator=g)), torch.randn(16, 3, generator=g)).backward()
            opt.step()
            if step == 2:  # the writer holds one record at the gate, two more are queued behind it
                gate.set()
    assert sorted(s for call in calls for s in call) == list(range(STEPS))  # each record written once
    assert max(len(call) for call in calls) >= 2  # some records were committed together

    with h5py.File(path, "r") as f:
        assert f[schema.RECORD_TABLE.at(schema.STEP, k=0)][()].tolist() == list(range(STEPS))
        assert f[schema.RECORD_TABLE.at(schema.BACKWARD_PASS, k=0)][()].tolist() == list(range(1, STEPS + 1))
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == STEPS
        for name, p in model.named_parameters():
            record = run.param(name)
            assert record.records.tolist() == list(range(STEPS))
            for row in range(STEPS):
                before, grad, after, exp_avg = seen[row][p]
                assert torch.equal(record.read(schema.KIND_PARAM, row), before)
                assert torch.equal(record.read(schema.KIND_GRAD, row), grad)
                assert torch.equal(record.read(schema.KIND_PARAM_AFTER, row), after)
                if exp_avg is not None:
                    assert torch.equal(record.read("state/exp_avg", row), exp_avg)
            # the comparison can fail: a row holds its own step's tensors, not its neighbour's
            assert not torch.equal(record.read(schema.KIND_GRAD, 3), seen[2][p][1])
    assert upd.verify(str(path)).exit_code == 0


# The child records Adam with full records at every step, its first write (record 0 alone) held back until two
# more records are queued, and is SIGKILLed by its own RecordRows.commit when several records are committed
# together: after that batch's rows were written and flushed, before its commit markers.
CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time, torch, upd
    from upd.runfile import full_rows
    from upd.runfile.writer import RunWriter

    gate, real_write, real_commit = threading.Event(), RunWriter.write, full_rows.RecordRows.commit
    def write(self, rec):
        if not getattr(self, "gated", False):
            self.gated = True
            gate.wait(60)
        return real_write(self, rec)
    def commit(self, first, steps):
        if len(steps) > 1:
            print("killed at", first, steps, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_commit(self, first, steps)
    RunWriter.write, full_rows.RecordRows.commit = write, commit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = upd.record(sys.argv[1], model, opt, every=1)
    for step in range(6):
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        while step == 0 and rec._writer.pending:  # the writer thread took record 0 alone: it waits at the gate
            time.sleep(0.001)
        if step == 2:
            gate.set()
    rec.close()
    print("finished", flush=True)
""")


@pytest.mark.slow  # a subprocess trains, records and is killed
def test_a_kill_between_a_batchs_rows_and_its_commit_keeps_the_records_before_it(tmp_path):
    path = str(tmp_path / "killed.h5")
    proc = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, cwd=REPO,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr  # a batch was committed: killed there
    first, steps = proc.stdout.split("killed at ", 1)[1].split(" ", 1)
    first = int(first)
    assert first == 1 and steps.count(",") >= 1  # record 0 was committed alone, the batch holds 2 or more
    with h5py.File(path, "r") as f:  # the batch's rows are in the file, past what readers see
        rows = f[schema.PARAMETER.at(schema.KIND_PARAM, k=0, name="0.weight")].shape[0]
        assert rows > first
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == first
        assert run.optimizers[0].steps.tolist() == list(range(first))
        assert all(p.records.tolist() == list(range(first)) for p in run.optimizers[0].param_records.values())
    assert upd.verify(path).exit_code == 0

    # resumed: the batch's leftover rows are dropped and the new records follow the committed ones
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(path, model, opt, every=1, resume=True):
        for _ in range(3):
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == first + 3
        assert all(p.num_rows == first + 3 for p in run.optimizers[0].param_records.values())
    # A fresh model resumed the run (the killed one left no checkpoint): the records before it no longer lead to
    # its first one, so verify reports the junction; every resumed record replays.
    checks = upd.verify(path).checks
    assert (checks[checks.record >= first].status == "match").all()
    assert len(checks[checks.record >= first]) == 3 * len(list(model.parameters()))
