"""`upd.record` options (every, include/exclude, what, dtype, compression, overwrite) and its lifecycle: every
hook it added is removed on close, however the recording ends.
"""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import upd
from upd.runfile import schema
from tests.harness.training import grads_of, loss_at, mlp, no_hooks_left, params_of, train


# -- options: every, include/exclude, what, dtype, compression --------------------------------------------------
def test_every_n_records_every_nth_step(tmp_path):
    path = tmp_path / "every.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = []
    with upd.record(path, model, opt, every=3):
        train(model, opt, 7, before_step=lambda s: before.append(params_of(model)))
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.steps.tolist() == [0, 3, 6]
        assert np.diff(o.backward_passes).tolist() == [3, 3]
        p = o.param_records["0.weight"]
        for row, step in enumerate([0, 3, 6]):
            assert torch.equal(p.read("param", row), before[step]["0.weight"])
            assert float(p.state_at(row).get("step", torch.tensor(0.0))) == step
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert report.matched == 3 * 4


@pytest.mark.parametrize("include, exclude, expected", [
    ("*.weight", None, ["0.weight", "2.weight"]),
    (None, "0.*", ["2.bias", "2.weight"]),
    (["0.*", "2.bias"], ["*.weight"], ["0.bias", "2.bias"]),
])
def test_include_exclude_globs(tmp_path, include, exclude, expected):
    path = tmp_path / "globs.h5"
    model = mlp(seed=13)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, include=include, exclude=exclude, every=1):
        train(model, opt, 2)
    with upd.open_run(path) as run:
        assert sorted(run.params()["param"]) == expected
        assert run.optimizers[0].num_records == 2
    assert upd.verify(path).exit_code == 0


def test_what_param_only_has_no_grad_or_state_and_is_not_verifiable(tmp_path):
    path = tmp_path / "what.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(path, model, opt, what=("param",), every=1):
        train(model, opt, 3)
    with h5py.File(path, "r") as f:
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            grp = f[schema.PARAMETER.path(k=0, name=name)]
            assert "param" in grp and "param_after" in grp
            assert "grad" not in grp
            assert len(grp["state"]) == 0  # no state datasets
            assert grp["param"].shape[0] == 3
    report = upd.verify(path)
    assert report.exit_code == 3
    assert (report.checks["status"] == "skipped").all()
    assert report.checks["note"].str.contains("grad not recorded").all()


def test_what_param_grad_without_state_verifies_only_the_first_step(tmp_path):
    path = tmp_path / "nostate.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(path, model, opt, what=("param", "grad"), every=1):
        train(model, opt, 3)
    with upd.open_run(path) as run:
        assert all(p.state_keys == [] for p in run.iter_params())
    report = upd.verify(path)
    checks = report.checks
    assert checks[checks["step"] == 0]["status"].tolist() == ["match"] * 4
    later = checks[checks["step"] > 0]
    assert (later["status"] == "skipped").all()
    assert later["note"].str.contains("state not recorded").all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_reduced_precision_storage(tmp_path, dtype, opt_name):
    path = tmp_path / f"{dtype}.h5"
    model = mlp(seed=13)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "SGD"
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    before, grads = [], []

    def snap(_s):
        before.append(params_of(model))
        grads.append(grads_of(model))

    with upd.record(path, model, opt, dtype=dtype, every=1):
        train(model, opt, 4, before_step=snap)
    target = getattr(torch, dtype)
    with upd.open_run(path) as run:
        for name, p in run.optimizers[0].param_records.items():
            assert p.storage_dtype("param") == dtype and p.dtype == "float32"
            for row in range(4):
                stored = p.read("param", row)
                assert stored.dtype == target
                assert torch.equal(stored, before[row][name].to(target))
                assert torch.equal(p.read("grad", row), grads[row][name].to(target))
            assert torch.equal(p.read("param_after", 3), params_of(model)[name].to(target))
    with h5py.File(path, "r") as f:
        ds = f[schema.PARAMETER.at(schema.KIND_PARAM, k=0, name='0.weight')]
        assert ds.dtype == (np.float16 if dtype == "float16" else np.uint16)
        assert ds.attrs["torch_dtype"] == dtype
    report = upd.verify(path)
    assert report.mismatched == 0, report.summary()
    assert report.exit_code == 0
    assert report.precision_notes and all(dtype in n for n in report.precision_notes)


def test_float16_storage_no_false_mismatch_with_small_adam_grads(tmp_path):
    path = tmp_path / "f16_small.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(path, model, opt, dtype="float16", every=1):
        for s in range(4):
            opt.zero_grad()
            (0.01 * loss_at(model, s)).backward()  # gradients ~1e-3..1e-2, common in real networks
            opt.step()
    report = upd.verify(path)
    assert report.mismatched == 0, report.summary()
    assert report.exit_code == 0


def test_reduced_precision_keeps_the_step_counter_exact(tmp_path):
    path = tmp_path / "bf16_resumed.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, opt, 300)  # a resumed run: the optimizer already took 300 steps
    with upd.record(path, model, opt, dtype="bfloat16", every=1):
        train(model, opt, 3)
    with upd.open_run(path) as run:
        assert run.optimizers[0].steps.tolist() == [300, 301, 302]
        p = run.param("0.weight")
        assert [float(p.state_at(row)["step"]) for row in range(3)] == [300.0, 301.0, 302.0]


def test_gzip_compression(tmp_path):
    path = tmp_path / "gzip.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    with upd.record(path, model, opt, compression="gzip", every=1):
        train(model, opt, 3, before_step=lambda s: grads.append(grads_of(model)))
    with h5py.File(path, "r") as f:
        grp = f[schema.PARAMETER.path(k=0, name='0.weight')]
        for kind in ("param", "grad", "param_after", "state/exp_avg"):
            assert grp[kind].compression == "gzip", kind
        np.testing.assert_array_equal(grp["grad"][1], grads[1]["0.weight"].numpy())
    assert upd.verify(path).exit_code == 0


# -- overwrite, and every hook removed on close -----------------------------------------------------------------
def test_refuses_to_overwrite_unless_asked(tmp_path):
    path = tmp_path / "exists.h5"
    path.write_bytes(b"precious")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FileExistsError):
        upd.record(path, model, opt, every=1)
    assert path.read_bytes() == b"precious"
    assert no_hooks_left(opt, model)
    with upd.record(path, model, opt, overwrite=True, every=1):
        train(model, opt, 2)
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 2


def test_with_block_removes_every_hook(tmp_path):
    path = tmp_path / "hooks.h5"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, every=1) as rec:
        train(model, opt, 2)
        assert opt._optimizer_step_pre_hooks and opt._optimizer_step_post_hooks
    assert not rec.active
    assert no_hooks_left(opt, model)
    train(model, opt, 3)  # training after close adds nothing
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 2
        assert run.param("0.weight").num_rows == 2


def test_explicit_close_removes_every_hook(tmp_path):
    path = tmp_path / "close.h5"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = upd.record(path, model, opt, every=1)
    train(model, opt, 3)
    assert rec.records == 3
    rec.close()
    rec.close()  # twice is fine
    assert no_hooks_left(opt, model)
    train(model, opt, 2)
    assert rec.records == 3
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 3
