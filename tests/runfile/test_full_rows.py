"""Full records appended through dataset handles kept open (upd/runfile/full_rows.py): every row lands where the
file says it is, read back with plain h5py, as the run grows (a param group added mid-run, closure losses, state
keys), and after a record that failed half-way and a resumed recorder that appends after the committed rows."""
from __future__ import annotations

import json
import warnings

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema
from upd.runfile.full_rows import Rows

LR_FIRST, LR_SECOND = 1e-2, 5e-2


def capture(opt) -> list:
    """Per optimizer step: {parameter: [before, grad, after]}, cloned by the optimizer's step hooks."""
    seen = []

    def before(o, args, kwargs):
        seen.append({p: [p.detach().clone()] for g in o.param_groups for p in g["params"]})

    def after(o, args, kwargs):  # a closure computes the gradients inside step(): they are read after it
        for p, kept in seen[-1].items():
            kept += [p.grad.clone(), p.detach().clone()]

    opt.register_step_pre_hook(before)
    opt.register_step_post_hook(after)
    return seen


def closure_step(model, opt, x, y) -> float:
    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return opt.step(closure).item()


def param_rows(f: h5py.File, name: str) -> dict:
    grp = f[schema.PARAMETER.path(k=0, name=schema.param_key(name))]
    out = {kind: torch.from_numpy(grp[kind][()]) for kind in schema.TENSOR_KINDS if kind in grp}
    out["records"] = grp[schema.RECORD_INDEX][()].tolist()
    out["present"] = grp[schema.STATE_PRESENT][()]
    out["state_keys"] = json.loads(grp[schema.STATE_GROUP].attrs[schema.STATE_KEYS])
    out["step"] = grp[schema.STATE_GROUP]["step"][()].tolist()
    return out


def assert_rows_hold(rows: dict, records: list, steps: list, seen: list, p: torch.Tensor) -> None:
    """Row i of each tensor of parameter p is what p was at the optimizer step of record rows['records'][i]."""
    assert rows["records"] == records
    for i, record in enumerate(records):
        before, grad, after = seen[steps[record]][p]
        assert torch.equal(rows[schema.KIND_PARAM][i], before)
        assert torch.equal(rows[schema.KIND_GRAD][i], grad)
        assert torch.equal(rows[schema.KIND_PARAM_AFTER][i], after)


def test_rows_of_a_growing_run_are_the_tensors_of_their_records(tmp_path):
    path = tmp_path / "growing.h5"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model[0].parameters(), lr=LR_FIRST)
    seen = capture(opt)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    losses = []
    with upd.record(path, model, opt, every=1):
        for step in range(5):
            if step == 2:  # a param group added mid-run: the lr table gains a column, new parameters gain groups
                opt.add_param_group({"params": list(model[1].parameters()), "lr": LR_SECOND})
            losses.append(closure_step(model, opt, x, y))

    with h5py.File(path, "r") as f:
        table = f[schema.RECORD_TABLE.path(k=0)]
        steps = table[schema.STEP][()].tolist()
        assert steps == [0, 1, 2, 3, 4]
        np.testing.assert_array_equal(table[schema.LR][()], [[LR_FIRST, np.nan]] * 2 + [[LR_FIRST, LR_SECOND]] * 3)
        assert [[g["lr"] for g in json.loads(text)] for text in table[schema.HPARAMS][()]] == \
            [[LR_FIRST]] * 2 + [[LR_FIRST, LR_SECOND]] * 3
        assert [json.loads(text) for text in table[schema.CLOSURE_LOSSES][()]] == [[loss] for loss in losses]
        for name, p in model.named_parameters():
            rows = param_rows(f, name)
            records = [0, 1, 2, 3, 4] if name.startswith("0.") else [2, 3, 4]
            assert_rows_hold(rows, records, steps, seen, p)
            assert rows["state_keys"] == ["step", "exp_avg", "exp_avg_sq"]
            # The state before each step: none before a parameter's first (the mask says so, the row is the fill).
            assert rows["present"].tolist() == [[0, 0, 0]] + [[1, 1, 1]] * (len(records) - 1)
            assert rows["step"] == [float(n) for n in range(len(records))]
        # The comparison catches a row in the wrong place: record 3's row of a weight is not record 2's.
        rows = param_rows(f, "0.weight")
        with pytest.raises(AssertionError):
            assert_rows_hold(rows, [0, 1, 2, 3, 4], [0, 1, 3, 3, 4], seen, model[0].weight)
    assert upd.verify(str(path)).exit_code == 0


def test_a_resumed_recorder_appends_after_the_rows_of_a_failed_record(tmp_path, monkeypatch):
    path = tmp_path / "resumed.h5"
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=LR_FIRST)
    seen = capture(opt)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    real = Rows.write_tensor
    calls = {"n": 0}
    per_record = 4 * 6  # 4 parameters: param, grad, param_after and the state step, exp_avg, exp_avg_sq
    monkeypatch.setattr("upd.runfile.async_writer.FULL_BATCH", 1)  # one record a call: counts per record

    def write_tensor(self, row, tensor):
        calls["n"] += 1
        if calls["n"] == 2 * per_record + 6 + 3:  # record 2, second parameter: some of its rows are written
            raise OSError("No space left on device")
        return real(self, row, tensor)

    monkeypatch.setattr(Rows, "write_tensor", write_tensor)
    with pytest.warns(upd.RecorderWarning, match="No space left on device"):
        with upd.record(path, model, opt, every=1):
            for _ in range(3):
                closure_step(model, opt, x, y)
    monkeypatch.setattr(Rows, "write_tensor", real)
    with h5py.File(path, "r") as f:  # the failed record left rows behind that no record index points to yet
        assert f[schema.PARAMETER.at(schema.KIND_PARAM, k=0, name="0.weight")].shape[0] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", upd.RecorderWarning)
        with upd.record(path, model, opt, resume=True, every=1):
            for _ in range(2):
                closure_step(model, opt, x, y)

    with h5py.File(path, "r") as f:
        steps = f[schema.RECORD_TABLE.at(schema.STEP, k=0)][()].tolist()
        assert steps == [0, 1, 3, 4]  # Adam's own step count numbers the records; step 2 was never committed
        for name, p in model.named_parameters():
            rows = param_rows(f, name)
            assert_rows_hold(rows, [0, 1, 2, 3], steps, seen, p)
            assert rows["step"] == [0.0, 1.0, 3.0, 4.0]
    assert upd.verify(str(path)).exit_code == 0
