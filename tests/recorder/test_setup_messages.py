"""Natural mistakes at upd.record(...) get a message that says what happened and what to write instead."""
import warnings

import pytest
import torch

import upd

from tests.harness.training import MLP, loss_at, mlp, train_steps


def test_an_include_pattern_that_matches_nothing_warns_at_record_time(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(upd.RecorderWarning, match=r"match none of the parameters \(fc1.weight, fc1.bias"):
        rec = upd.record(tmp_path / "typo.h5", model, opt, include="*.wieght", every=1)
    with rec:
        train_steps(model, opt, steps=2)
    with warnings.catch_warnings():  # the right pattern: no warning
        warnings.simplefilter("error", upd.RecorderWarning)
        with upd.record(tmp_path / "ok.h5", model, opt, include="*.weight", every=1):
            train_steps(model, opt, steps=2)
    with upd.open_run(tmp_path / "ok.h5") as run:
        assert [p.name for p in run.iter_params()] == ["fc1.weight", "fc2.weight"]


def test_the_optimizer_in_the_model_slot_says_what_to_write(tmp_path):
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    with pytest.warns(upd.RecorderWarning, match=r"optimizer was passed as the model.*upd.record\(path, model, "
                                                 r"optimizer\)"):
        rec = upd.record(tmp_path / "x.h5", opt, every=1)
    assert not rec.active and not (tmp_path / "x.h5").exists()
    with pytest.raises(TypeError, match="passed as the model"):
        upd.record(tmp_path / "x.h5", opt, strict=True, every=1)
    with pytest.warns(upd.RecorderWarning, match="needs the optimizer"):  # a model alone: the message as before
        upd.record(tmp_path / "x.h5", model, every=1)


def test_a_path_still_being_recorded_in_this_process_names_the_recorder(tmp_path):
    """Re-running a notebook cell: the first recorder still holds the file."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.h5"
    first = upd.record(path, model, opt, every=1)
    try:
        with pytest.warns(upd.RecorderWarning, match=r"still recording to this file; close it first") as caught:
            second = upd.record(path, model, opt, overwrite=True, every=1)
        assert "HDF5" not in str(caught[0].message) and "unable" not in str(caught[0].message)
        assert not second.active and first.active
        loss_at(model, 0).backward()
        opt.step()  # the first recorder goes on recording
    finally:
        first.close()
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 1
    with upd.record(path, model, opt, overwrite=True, every=1) as third:  # closed: the path is free again
        assert third.active


def test_a_directory_path_is_refused_with_what_to_pass(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for overwrite in (False, True):
        with pytest.raises(IsADirectoryError, match=r"is a directory.*pass a file path, e.g. .*run.h5"):
            upd.record(tmp_path, model, opt, overwrite=overwrite, every=1)
    assert list(tmp_path.iterdir()) == []


def test_the_repr_counts_full_records_as_info_does(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(tmp_path / "run.h5", model, opt, every=4, stats_every=1) as rec:
        train_steps(model, opt, steps=9)
        assert repr(rec).endswith("recording, 3 full-tensor records, 9 statistics steps>")
    with upd.open_run(tmp_path / "run.h5") as run:
        assert run.optimizers[0].num_records == rec.full_records == 3
    assert "closed, 3 full-tensor records" in repr(rec)


def test_help_of_upd_record_documents_every_option():
    import inspect

    from upd.recorder.recorder import Recorder

    doc = inspect.getdoc(upd.record)
    options = [name for name in inspect.signature(Recorder).parameters if name not in ("path", "model", "optimizer")]
    documented = {name for line in doc.splitlines() for name in options
                  if line.startswith(f"    {name}:") or line.startswith(f"    {name} /") or f"/ {name}:" in line}
    assert sorted(set(options) - documented) == []
    assert "rec.log(" in doc
