"""Resuming a run written by an earlier version: columns the schema declares optional (added later) may be absent
from it, and the writer goes on without them rather than stopping the recording."""
import warnings

import h5py
import torch

import upd
from upd.runfile import schema

from tests.harness.training import MLP, train_steps


def test_resuming_a_run_without_an_optional_column_keeps_recording(tmp_path):
    path = str(tmp_path / "old.h5")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=2)
    optional = [d.name for d in schema.RECORD_TABLE.datasets if not d.required]
    assert optional == [schema.CLOSURE_LOSSES]
    with h5py.File(path, "r+") as f:  # as the sample runs, written before closure_losses existed
        del f[schema.RECORD_TABLE.at(schema.CLOSURE_LOSSES, k=0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", upd.RecorderWarning)  # before the fix: "recording ... stopped (KeyError)"
        with upd.record(path, model, opt, resume=True, every=1):
            train_steps(model, opt, steps=2)
    with upd.open_run(path) as run:
        opt_run = run.optimizers[0]
        assert opt_run.steps.tolist() == [0, 1, 2, 3]
        assert [opt_run.closure_losses(r) for r in range(4)] == [None] * 4
    with h5py.File(path, "r") as f:
        assert schema.CLOSURE_LOSSES not in f[schema.RECORD_TABLE.path(k=0)]
    assert upd.verify(path).exit_code == 0
