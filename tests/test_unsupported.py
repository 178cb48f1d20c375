"""Tensors the recorder cannot store as they are, and parameters that change under it: training always goes on."""
import warnings

import pytest
import torch
from torch import nn

import upd

from conftest import MLP, train_steps


def record_and_count_warnings(path, model, opt, steps, between=None, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, model, opt, **options) as rec:
            for step in range(steps):
                if between is not None:
                    between(step)
                opt.zero_grad()
                model(torch.randn(4, model[0].in_features)).pow(2).mean().backward()
                opt.step()
    return rec, [w for w in caught if issubclass(w.category, upd.RecorderWarning)]


def test_parameter_that_changes_shape_stops_recording_once(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def grow(step):
        if step == 3:  # e.g. a vocabulary resize in place: same Parameter object, new shape
            with torch.no_grad():
                model[0].bias.data = torch.zeros(5)
                model[0].weight.data = torch.zeros(5, 6)

    path = str(tmp_path / "run.h5")
    rec, warned = record_and_count_warnings(path, model, opt, 6, between=grow)
    assert len(warned) == 1 and rec.error is not None
    assert list(model[0].bias.shape) == [5]  # training went on with the new shape
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].step) == [0, 1, 2]  # everything before the change is kept
    assert upd.verify(path).exit_code == 0


def test_strict_raises_on_a_shape_change(tmp_path):
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Exception):
        with upd.record(str(tmp_path / "run.h5"), model, opt, strict=True):
            for step in range(3):
                if step == 2:
                    model[0].bias.data = torch.zeros(5)
                    model[0].weight.data = torch.zeros(5, 6)
                opt.zero_grad()
                model(torch.randn(4, 6)).pow(2).mean().backward()
                opt.step()


def test_meta_tensor_parameter_warns_once_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    ghost = nn.Parameter(torch.empty(3, device="meta"))  # has no data to copy
    opt = torch.optim.SGD([*model.parameters(), ghost], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(str(tmp_path / "run.h5"), model, opt) as rec:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 6)).pow(2).mean().backward()
                ghost.grad = torch.empty(3, device="meta")
                opt.step()
    warned = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(warned) == 1 and rec.error is not None
    assert model.weight.grad is not None  # the three steps ran


def test_complex_parameters_are_recorded_and_not_falsely_verified(tmp_path):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    opt = torch.optim.Adam([weight], lr=1e-2)
    path = str(tmp_path / "run.h5")
    with upd.record(path, optimizer=opt):
        for _ in range(3):
            opt.zero_grad()
            (weight.abs() ** 2).sum().backward()
            opt.step()
    with upd.open_run(path) as run:
        p = run.param("group0.param0")
        assert p.dtype == "complex64" and p.read("param", 0).dtype == torch.complex64
        ratios = run.ratios()
    assert len(ratios) == 3
    report = upd.verify(path)
    assert report.exit_code == 3 and report.mismatched == 0  # refused with its reason, never a false fail
    assert "complex" in report.checks["note"].iloc[0]


def test_missing_folders_are_created(tmp_path):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "runs" / "exp1" / "run.h5"  # the README's first example records into runs/
    with upd.record(str(path), model, opt):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    assert upd.open_run(str(path)).optimizers[0].num_records == 1


def test_permission_denied_warns_and_training_goes_on(tmp_path, monkeypatch):
    import h5py

    def denied(*args, **kwargs):  # root bypasses chmod here, so the refusal is injected where the file opens
        raise PermissionError(13, "Permission denied", str(tmp_path / "run.h5"))

    monkeypatch.setattr(h5py, "File", denied)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(str(tmp_path / "run.h5"), model, opt) as rec:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(2, 3)).sum().backward()
                opt.step()
    warned = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(warned) == 1 and "Permission denied" in str(warned[0].message)
    assert isinstance(rec.error, PermissionError) and not opt._optimizer_step_pre_hooks
    with pytest.raises(PermissionError):
        upd.record(str(tmp_path / "run.h5"), model, opt, strict=True)


def test_run_file_deleted_while_recording(tmp_path):
    import os

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")

    def delete(step):
        if step == 3:
            os.remove(path)

    rec, warned = record_and_count_warnings(path, model, opt, 6, between=delete)
    assert len(warned) == 1 and "deleted or replaced" in str(warned[0].message)
    assert rec.error is not None
