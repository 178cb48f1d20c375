"""The recorder inside common training loops: LR schedulers, GradScaler-skipped steps, gradient clipping, gradient
accumulation, NaN / Inf gradients. Each test records a real loop and checks the file against what the loop saw.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import upd
from tests.harness.training import grads_of, loss_at, mlp, train


# -- LR scheduler --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["steplr", "onecycle"])
def test_lr_scheduler_lr_per_record(tmp_path, kind):
    path = tmp_path / f"{kind}.h5"
    model = mlp(seed=6)
    steps = 8
    if kind == "steplr":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=steps)  # also cycles beta1
    used_lr, used_betas = [], []
    with upd.record(path, model, opt, every=1):
        for s in range(steps):
            opt.zero_grad()
            loss_at(model, s).backward()
            used_lr.append(opt.param_groups[0]["lr"])
            used_betas.append(opt.param_groups[0].get("betas"))
            opt.step()
            sched.step()
    assert len(set(used_lr)) > 2  # the schedule really changed the lr
    with upd.open_run(path) as run:
        assert run.steps()["lr_group0"].tolist() == used_lr
        for r in range(steps):
            hp = run.optimizers[0].hparams(r)[0]
            assert hp["lr"] == used_lr[r]
            if kind == "onecycle":
                assert hp["betas"] == list(used_betas[r])
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    if kind == "onecycle":
        # The one-cycle schedule ends at max_lr / 2.5e5 = 2e-7: Adam then moves each weight by less than float32's
        # spacing at its size, and verify says the last step's checks are inconclusive instead of calling them ok.
        assert used_lr[-1] < 1e-6
        # (a bias near zero has a fine enough spacing to still be checked).
        last = report.checks["step"] == steps - 1
        assert (report.checks.loc[~last, "status"] == "match").all()
        assert "inconclusive" in set(report.checks.loc[last, "status"]) and report.mismatched == 0
    else:
        assert report.matched == steps * 4


# -- GradScaler-skipped step ----------------------------------------------------------------------------------
def test_gradscaler_skipped_step_leaves_a_gap_not_a_record(tmp_path):
    path = tmp_path / "amp.h5"
    model = mlp(seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    expected_grads = []
    with upd.record(path, model, opt, every=1):
        for s in range(5):
            opt.zero_grad()
            loss = loss_at(model, s)
            if s != 2:
                grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
                expected_grads.append(dict(zip([n for n, _ in model.named_parameters()], grads)))
            else:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 2.0**9  # the inf step really was skipped (scale backed off once)
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.num_records == 4  # five backward passes, four real steps, nothing fake
        assert o.steps.tolist() == [0, 1, 2, 3]
        assert np.diff(o.backward_passes).tolist() == [1, 2, 1]  # the skipped step shows as a jump of 2
        for name, p in o.param_records.items():
            assert p.records.tolist() == [0, 1, 2, 3]
            for row in range(4):
                g = p.read("grad", row)
                assert torch.isfinite(g).all()
                torch.testing.assert_close(g, expected_grads[row][name], rtol=1e-6, atol=0)
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


def test_backward_pass_counts_passes_before_the_first_step(tmp_path):
    # GradScaler with a too-large initial scale typically skips the very first step(s): that gap must show too.
    path = tmp_path / "amp_first.h5"
    model = mlp(seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with upd.record(path, model, opt, every=1):
        for s in range(4):
            opt.zero_grad()
            loss = loss_at(model, s)
            if s == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    with upd.open_run(path) as run:
        # Record 0 is the step after the 2nd backward pass (the 1st was skipped by the scaler).
        assert run.optimizers[0].backward_passes.tolist() == [2, 3, 4]


# -- gradient clipping --------------------------------------------------------------------------------------
def test_gradient_clipping_records_the_clipped_grad(tmp_path):
    path = tmp_path / "clip.h5"
    model = mlp(seed=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    max_norm = 0.05
    clipped, norms = [], []

    def clip(_s):
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        clipped.append(grads_of(model))

    with upd.record(path, model, opt, every=1):
        train(model, opt, 4, before_step=clip)
    assert min(norms) > max_norm  # clipping really changed every step's gradient
    with upd.open_run(path) as run:
        for row in range(4):
            total = 0.0
            for name, p in run.optimizers[0].param_records.items():
                g = p.read("grad", row)
                assert torch.equal(g, clipped[row][name])
                total += float(g.double().pow(2).sum())
            assert math.sqrt(total) <= max_norm * (1 + 1e-5)
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


# -- gradient accumulation ------------------------------------------------------------------------------------
def test_gradient_accumulation_one_record_per_step(tmp_path):
    path = tmp_path / "accum.h5"
    model = mlp(seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accum, steps = 3, 4
    expected = []
    with upd.record(path, model, opt, every=1):
        for s in range(steps):
            opt.zero_grad()
            total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            for k in range(accum):
                loss = loss_at(model, 10 * s + k) / accum
                for (n, _), g in zip(model.named_parameters(),
                                     torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)):
                    total[n] += g
                loss.backward()
            expected.append(total)
            opt.step()
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.num_records == steps
        assert o.steps.tolist() == list(range(steps))
        assert np.diff(o.backward_passes).tolist() == [accum] * (steps - 1)
        for name, p in o.param_records.items():
            assert p.num_rows == steps
            for row in range(steps):
                torch.testing.assert_close(p.read("grad", row), expected[row][name], rtol=1e-6, atol=1e-8)
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


# -- NaN / Inf in a gradient ---------------------------------------------------------------------------------
def test_nonfinite_grad_recorded_as_is_and_flagged(tmp_path):
    path = tmp_path / "nan.h5"
    model = mlp(seed=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def poison(s):
        if s == 2:
            model[0].weight.grad[1, 2] = float("nan")
            model[2].weight.grad[0, 0] = float("inf")
        seen.append(grads_of(model))

    with upd.record(path, model, opt, every=1):
        train(model, opt, 4, before_step=poison)
    with upd.open_run(path) as run:
        w0 = run.param("0.weight")
        g = w0.read("grad", 2)
        nan_mask = torch.zeros_like(g, dtype=torch.bool)
        nan_mask[1, 2] = True
        assert torch.equal(torch.isnan(g), nan_mask)
        assert torch.equal(g[~nan_mask], seen[2]["0.weight"][~nan_mask])
        g2 = run.param("2.weight").read("grad", 2)
        assert math.isinf(float(g2[0, 0])) and float(g2[0, 0]) > 0
        assert torch.isnan(w0.read("param_after", 2)[1, 2])  # SGD propagated it
        ratios = run.ratios()
    upto2 = ratios[ratios["record"] <= 2]  # from record 3 on the NaN weight makes every gradient NaN
    flagged = upto2[upto2["flag"].str.contains("nonfinite-grad")]
    assert sorted(zip(flagged["param"], flagged["record"])) == [("0.weight", 2), ("2.weight", 2)]
    assert ratios[ratios["record"] == 3]["flag"].str.contains("nonfinite-grad").all()
    row = ratios[(ratios["param"] == "0.weight") & (ratios["record"] == 2)].iloc[0]
    assert row["grad_nonfinite"] == 1
    assert not ratios[ratios["record"] < 2]["flag"].str.contains("nonfinite").any()
