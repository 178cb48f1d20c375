"""rec.log(loss=..., **scalars): per-step scalars stored in the run, on real training runs.

Values belong to the next optimizer step (after_step=True: the step just completed), tensors are read when the
step's record is written (never at the call), and run.steps() / run.scalars() / TensorBoard show them."""
import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import upd
from upd.recorder.logged_scalars import HOST_BATCH_STEPS
from upd.runfile import schema

from tests.harness.training import MLP, loss_at, mlp


def _loop(model, opt, rec, steps, log_before=True, log_after=False, clip=None):
    """A real loop; returns the loss of each step as the loop saw it (read with .item() here, for the check)."""
    seen = []
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if log_before:
            rec.log(loss=loss, index=i)
        opt.step()
        if log_after:
            rec.log(after_step=True, done=i)
        seen.append(loss.item())
    return seen


def test_logged_values_belong_to_the_step_that_follows_and_show_in_steps(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.h5"
    with upd.record(path, model, opt, every=3) as rec:
        seen = _loop(model, opt, rec, 8, log_after=True)
    with upd.open_run(path) as run:
        steps, scalars = run.steps(), run.scalars()
    assert list(scalars["step"]) == list(range(8))
    assert list(scalars["loss"]) == pytest.approx(seen, rel=1e-7)  # float32 losses, read exactly
    assert list(scalars["index"]) == list(range(8))  # logged before step i: step i
    assert list(scalars["done"]) == list(range(8))  # logged after step i with after_step=True: step i too
    # run.steps(): a row per step, the records at 0, 3, 6 and <NA> where a step has logged values only
    assert list(steps["step"]) == list(range(8))
    assert steps["record"].tolist() == [0, pd.NA, pd.NA, 1, pd.NA, pd.NA, 2, pd.NA]
    assert list(steps["loss"]) == pytest.approx(seen, rel=1e-7)
    assert np.isnan(steps.loc[1, "lr_group0"]) and steps.loc[3, "lr_group0"] == 0.1
    # A value logged with the wrong rule would be one step off: the check sees it.
    assert list(scalars["loss"]) != pytest.approx([seen[0]] + seen[:-1], rel=1e-7)


def test_a_run_without_logged_scalars_keeps_its_steps_table(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(tmp_path / "run.h5", model, opt, every=2) as rec:
        _loop(model, opt, rec, 4, log_before=False)
    with upd.open_run(tmp_path / "run.h5") as run:
        steps = run.steps()
        # the recorder's own total gradient norms are logged at the recorded steps only: no extra rows
        assert list(run.scalars()["step"]) == [0, 2]
    assert list(steps["step"]) == [0, 2] and steps["record"].dtype == np.int64
    assert steps["backward_pass"].dtype == np.int64


def test_a_tensor_is_read_when_the_step_is_written_not_at_the_call(tmp_path):
    """rec.log keeps the tensor (no host copy, no device sync at the call); its value is read with the step's
    record. Changing the tensor in place after logging it, before the step, shows in the file: proof of when."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(tmp_path / "run.h5", model, opt, every=1) as rec:
        loss = loss_at(model, 0)
        loss.backward()
        logged = loss.detach().clone()
        rec.log(loss=logged)
        logged.add_(100.0)
        opt.step()
    with upd.open_run(tmp_path / "run.h5") as run:
        assert run.scalars()["loss"].tolist() == [pytest.approx(loss.item() + 100.0)]


def test_values_that_are_not_one_number_and_reserved_names_are_refused(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(tmp_path / "run.h5", model, opt, every=1) as rec:
        with pytest.raises(TypeError, match="shape \\(2,\\)"):
            rec.log(loss=torch.ones(2))
        with pytest.raises(TypeError, match="str"):
            rec.log(loss="low")
        with pytest.raises(TypeError, match="complex"):
            rec.log(z=torch.ones(1, dtype=torch.complex64))
        for name in ("step", "record", "lr_group0", schema.SCALAR_GRAD_NORM_AT_STEP):
            with pytest.raises(ValueError, match=repr(name)):
                rec.log(**{name: 1.0})
        rec.log(loss=torch.tensor([2.0]), n=np.float32(3), k=4)  # 1-element tensors and numpy numbers are fine
        loss_at(model, 0).backward()
        opt.step()
        assert rec.active  # a refused call stops nothing
    with upd.open_run(tmp_path / "run.h5") as run:
        row = run.scalars().iloc[0]
    assert (row["loss"], row["n"], row["k"]) == (2.0, 3.0, 4.0)


def test_statistics_mode_steps_show_every_logged_step(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with upd.record(tmp_path / "run.h5", model, opt, every=None, stats_every=2) as rec:
        seen = _loop(model, opt, rec, 5)
    with upd.open_run(tmp_path / "run.h5") as run:
        steps = run.steps()
    assert list(steps["step"]) == list(range(5)) and steps["record"].isna().all()
    assert list(steps["loss"]) == pytest.approx(seen, rel=1e-7)


@pytest.mark.slow
def test_steps_without_a_record_are_written_in_batches_and_at_close(tmp_path):
    """Values of steps that write nothing else wait at most HOST_BATCH_STEPS steps: a live reader sees them."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "run.h5"
    rec = upd.record(path, model, opt, every=1000)
    try:
        _loop(model, opt, rec, HOST_BATCH_STEPS + 5)
        rec._writer._call(lambda: None)  # the writer thread has written everything handed to it before this call
        with upd.open_run(path) as run:  # live: a copy between two records
            assert run.live
            written = run.scalars()["step"].tolist()
        assert written == list(range(HOST_BATCH_STEPS + 1))  # step 0 with its record, then a batch of 64
    finally:
        rec.close()
    with upd.open_run(path) as run:
        assert run.scalars()["step"].tolist() == list(range(HOST_BATCH_STEPS + 5))


def test_a_closure_steps_loss_is_logged_as_loss(tmp_path):
    """LBFGS: the loss of the first closure evaluation (at the parameters before the step) is the step's loss, at
    every step, recorded or not; closure_losses keeps every evaluation at recorded steps."""
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    with upd.record(tmp_path / "run.h5", model, opt, every=2):
        for s in range(4):
            def closure():
                opt.zero_grad()
                loss = loss_at(model, s)
                loss.backward()
                return loss
            opt.step(closure)
    with upd.open_run(tmp_path / "run.h5") as run:
        scalars = run.scalars()
        first = [run.optimizers[0].closure_losses(r)[0] for r in range(run.optimizers[0].num_records)]
    assert list(scalars["step"]) == [0, 1, 2, 3]
    assert list(scalars.loc[scalars["step"].isin([0, 2]), "loss"]) == pytest.approx(first, rel=1e-7)
    assert scalars["loss"].notna().all()


def test_several_optimizers_each_value_goes_to_the_one_that_steps_next(tmp_path):
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(2, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)
    with upd.record(tmp_path / "run.h5", None, [opt_a, opt_b], every=1) as rec:
        for step in range(2):
            loss = b(a(torch.randn(4, 3))).pow(2).mean()
            loss.backward()
            rec.log(loss=loss)
            opt_a.step()
            rec.log(b_only=step + 10)
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
    with upd.open_run(tmp_path / "run.h5") as run:
        scalars = run.scalars()
    assert scalars.loc[scalars["optimizer"] == 0, "loss"].notna().tolist() == [True, True]
    assert scalars.loc[scalars["optimizer"] == 1, "b_only"].tolist() == [10, 11]
    assert scalars.loc[scalars["optimizer"] == 1, "loss"].isna().all()


def test_a_resumed_run_continues_the_scalars(tmp_path):
    path = tmp_path / "run.h5"
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(path, model, opt, every=1) as rec:
        first = _loop(model, opt, rec, 3)
    with upd.record(path, model, opt, resume=True, every=1) as rec:
        second = _loop(model, opt, rec, 2)
    with upd.open_run(path) as run:
        scalars = run.scalars()
    assert list(scalars["step"]) == [0, 1, 2, 3, 4]
    assert list(scalars["loss"]) == pytest.approx(first + second, rel=1e-7)


def test_a_hostile_scalars_table_is_one_clear_error(tmp_path):
    path = tmp_path / "run.h5"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, every=1) as rec:
        loss_at(model, 0).backward()
        rec.log(loss=1.0)
        opt.step()
    with h5py.File(path, "r+") as f:
        table = f[f"optimizers/0/{schema.SCALARS}"]
        assert table[schema.VALUES].shape == (1, 3)  # loss and the two total gradient norms
        table.attrs[schema.SCALAR_COLUMNS] = '["step", "a", "b"]'
    with upd.open_run(path) as run, pytest.raises(upd.RunFileError, match="keys"):
        run.scalars()
    with h5py.File(path, "r+") as f:
        f[f"optimizers/0/{schema.SCALARS}"].attrs[schema.SCALAR_COLUMNS] = "[]"
    with upd.open_run(path) as run, pytest.raises(upd.RunFileError, match="names 0"):
        run.scalars()
