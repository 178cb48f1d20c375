"""Recorder errors never kill training: a failing write warns once, stops recording, removes the hooks and leaves
every committed record readable; `strict=True` raises instead.
"""
from __future__ import annotations

import warnings

import h5py
import pytest
import torch

import upd
from upd.runfile import schema
from upd.runfile.full_rows import Rows
from upd.runfile.writer import RunWriter
from tests.harness.training import assert_same_params, mlp, no_hooks_left, train


# -- recorder errors never kill training ------------------------------------------------------------------------
def _failing_write(monkeypatch, fail_on_call: int):
    monkeypatch.setattr("upd.runfile.async_writer.FULL_BATCH", 1)  # the failing call is one record
    real = RunWriter.write
    calls = {"n": 0}

    def write(self, rec):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            raise OSError("No space left on device")
        return real(self, rec)

    monkeypatch.setattr(RunWriter, "write", write)
    return calls


def test_write_error_warns_once_and_training_continues(tmp_path, monkeypatch):
    path = tmp_path / "full.h5"
    _failing_write(monkeypatch, fail_on_call=3)
    model = mlp(seed=15)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, model, opt, every=1) as rec:
            train(model, opt, 6)
    rec_warnings = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(rec_warnings) == 1
    assert "No space left on device" in str(rec_warnings[0].message)
    assert isinstance(rec.error, OSError) and not rec.active
    assert no_hooks_left(opt, model)
    plain = mlp(seed=15)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    train(plain, plain_opt, 6)
    assert_same_params(model, plain)  # all six steps happened, exactly as without the recorder
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 2
        assert run.optimizers[0].steps.tolist() == [0, 1]
        assert run.param("0.weight").num_rows == 2
    assert upd.verify(path).exit_code == 0


def test_error_in_the_middle_of_a_record_leaves_only_committed_records(tmp_path, monkeypatch):
    path = tmp_path / "partial.h5"
    real = Rows.write_tensor
    calls = {"n": 0}
    per_record = 4 * 3  # SGD without momentum: param, grad, param_after for each of the 4 params
    monkeypatch.setattr("upd.runfile.async_writer.FULL_BATCH", 1)  # one record a call: counts per record

    def write_tensor(self, row, tensor):
        calls["n"] += 1
        if calls["n"] == 2 * per_record + 5:  # record 2, second parameter: some of its rows are on disk
            raise OSError("No space left on device")
        return real(self, row, tensor)

    monkeypatch.setattr(Rows, "write_tensor", write_tensor)
    model = mlp(seed=15)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(upd.RecorderWarning, match="No space left on device"):
        with upd.record(path, model, opt, every=1):
            train(model, opt, 4)
    with h5py.File(path, "r") as f:
        assert f[schema.RECORD_TABLE.at(schema.STEP, k=0)].shape == (2,)
        assert f[schema.PARAMETER.at(schema.KIND_PARAM, k=0, name='0.weight')].shape[0] == 3  # a row of the uncommitted record exists
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.num_records == 2
        for p in o.param_records.values():
            assert p.records.tolist() == [0, 1]  # the uncommitted record is invisible
    report = upd.verify(path)
    assert report.exit_code == 0 and report.matched == 2 * 4


def test_write_error_with_strict_propagates(tmp_path, monkeypatch):
    path = tmp_path / "strict.h5"
    _failing_write(monkeypatch, fail_on_call=2)
    model = mlp(seed=15)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OSError, match="No space left on device"):
        with upd.record(path, model, opt, strict=True, every=1):
            train(model, opt, 4)
    assert no_hooks_left(opt, model)
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 1


def test_write_error_does_not_break_other_step_hooks(tmp_path, monkeypatch):
    path = tmp_path / "otherhook.h5"
    _failing_write(monkeypatch, fail_on_call=2)
    model = mlp(seed=15)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    user_calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", upd.RecorderWarning)
        with upd.record(path, model, opt, every=1):
            opt.register_step_post_hook(lambda o, a, k: user_calls.append(1))  # e.g. an EMA or a logger
            train(model, opt, 4)  # must not raise
    assert len(user_calls) == 4
