"""What the recorder writes for each shape of model and optimizer: parameters without a gradient in some steps,
frozen parameters, several param groups, a param group added mid-run, two optimizers, tied parameters, names without
a model, parameters on a GPU.

Every test trains a small nn model with a real torch.optim optimizer for a few deterministic steps, records it, and
asserts concrete values against what the training loop itself saw (gradients, learning rates, parameters).
"""
from __future__ import annotations

import math

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema
from tests.harness.training import (D_HID, D_IN, D_OUT, assert_same_params, batch, grads_of, loss_at, mlp,
                                    params_of, train)


# -- parameter without a gradient in some steps ----------------------------------------------------------------
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.trunk = nn.Linear(D_IN, D_OUT)
        self.branch = nn.Linear(D_OUT, D_OUT)

    def forward(self, x, use_branch: bool):
        h = self.trunk(x)
        return h + self.branch(h) if use_branch else h


def test_param_without_grad_has_no_row_at_those_records(tmp_path):
    path = tmp_path / "branch.h5"
    model = Branchy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen_grads, seen_params = [], []
    with upd.record(path, model, opt, every=1):
        for s in range(6):
            opt.zero_grad()  # set_to_none: the unused branch has grad None on odd steps
            x, y = batch(s)
            nn.functional.mse_loss(model(x, use_branch=s % 2 == 0), y).backward()
            seen_grads.append(grads_of(model))
            seen_params.append(params_of(model))
            opt.step()
    with upd.open_run(path) as run:
        trunk, branch = run.param("trunk.weight"), run.param("branch.weight")
        assert trunk.records.tolist() == [0, 1, 2, 3, 4, 5]
        assert branch.records.tolist() == [0, 2, 4]
        assert run.param("branch.bias").records.tolist() == [0, 2, 4]
        for row, record in enumerate(branch.records):
            assert "branch.weight" in seen_grads[record]
            assert torch.equal(branch.read("grad", row), seen_grads[record]["branch.weight"])
            assert torch.equal(branch.read("param", row), seen_params[record]["branch.weight"])
        assert all("branch.weight" not in seen_grads[r] for r in (1, 3, 5))
        # Adam's state for the branch advanced only on the steps it had a gradient.
        assert float(branch.state_at(2)["step"]) == 2.0
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert report.mismatched == 0


# -- frozen parameters --------------------------------------------------------------------------------------
def _frozen_run(path=None):
    model = mlp(seed=2)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the frozen params are in the optimizer
    if path is None:
        train(model, opt, 4)
    else:
        with upd.record(path, model, opt, every=1):
            train(model, opt, 4)
    return model, opt


def test_frozen_params_never_recorded_and_training_unaffected(tmp_path):
    path = tmp_path / "frozen.h5"
    initial = params_of(mlp(seed=2))
    model, opt = _frozen_run(path)
    plain, _ = _frozen_run(None)
    assert_same_params(model, plain)
    assert torch.equal(model[0].weight, initial["0.weight"])
    with upd.open_run(path) as run:
        assert sorted(run.params()["param"]) == ["2.bias", "2.weight"]
        assert run.params_not_optimized == []  # they are in the optimizer, just frozen
        assert run.optimizers[0].num_records == 4
        assert run.param("2.weight").records.tolist() == [0, 1, 2, 3]
    assert upd.verify(path).exit_code == 0


# -- several param groups ----------------------------------------------------------------------------------
def test_param_groups_with_different_hyperparameters(tmp_path):
    path = tmp_path / "groups.h5"
    model = mlp(seed=3)
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[2].parameters(), "lr": 0.01, "weight_decay": 0.1}], momentum=0.9)
    with upd.record(path, model, opt, every=1):
        train(model, opt, 4)
    with upd.open_run(path) as run:
        groups = dict(zip(run.params()["param"], run.params()["group"]))
        assert groups == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1}
        steps = run.steps()
        assert steps["lr_group0"].tolist() == [0.1] * 4
        assert steps["lr_group1"].tolist() == [0.01] * 4
        hp = run.optimizers[0].hparams(2)
        assert hp[0]["weight_decay"] == 0 and hp[1]["weight_decay"] == 0.1
        assert hp[0]["momentum"] == hp[1]["momentum"] == 0.9
    # Replaying with the wrong group's lr / weight decay would not match.
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert report.matched == 16


# -- add_param_group mid-run -------------------------------------------------------------------------------
class TwoPart(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Linear(D_IN, D_HID)
        self.b = nn.Linear(D_HID, D_OUT)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_add_param_group_mid_run(tmp_path):
    path = tmp_path / "addgroup.h5"
    model = TwoPart()
    b_initial = model.b.weight.detach().clone()
    opt = torch.optim.Adam(model.a.parameters(), lr=1e-2)
    with upd.record(path, model, opt, every=1):
        for s in range(6):
            if s == 3:
                opt.add_param_group({"params": list(model.b.parameters()), "lr": 5e-3})
            opt.zero_grad()
            loss_at(model, s).backward()
            opt.step()
    with upd.open_run(path) as run:
        assert run.params_not_optimized == ["b.weight", "b.bias"]  # at the time recording started
        a, b = run.param("a.weight"), run.param("b.weight")
        assert a.records.tolist() == [0, 1, 2, 3, 4, 5]
        assert b.records.tolist() == [3, 4, 5]
        assert run.param("b.bias").records.tolist() == [3, 4, 5]
        assert a.param_group == 0 and b.param_group == 1
        assert torch.equal(b.read("param", 0), b_initial)  # untouched until it joined the optimizer
        steps = run.steps()
        assert steps["lr_group0"].tolist() == [1e-2] * 6
        lr1 = steps["lr_group1"].tolist()
        assert all(math.isnan(v) for v in lr1[:3]) and lr1[3:] == [5e-3] * 3
        assert b.state_at(0) == {}  # fresh state when it joined
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    b_checks = report.checks[report.checks["param"] == "b.weight"]
    assert b_checks["status"].tolist() == ["match"] * 3


# -- two optimizers -----------------------------------------------------------------------------------------
def test_two_optimizers_recorded_together(tmp_path):
    path = tmp_path / "two.h5"
    model = mlp(seed=5)
    opt1 = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    opt2 = torch.optim.Adam(model[2].parameters(), lr=1e-2)
    head_grads = []
    with upd.record(path, model, [opt1, opt2], every=1):
        for s in range(6):
            opt1.zero_grad()
            opt2.zero_grad()
            loss_at(model, s).backward()
            opt1.step()
            if s % 2 == 0:
                head_grads.append(model[2].weight.grad.clone())
                opt2.step()
    with upd.open_run(path) as run:
        assert len(run.optimizers) == 2
        o1, o2 = run.optimizers
        assert o1.class_name == "torch.optim.SGD" and o2.class_name == "torch.optim.Adam"
        assert sorted(o1.param_records) == ["0.bias", "0.weight"]
        assert sorted(o2.param_records) == ["2.bias", "2.weight"]
        assert o1.num_records == 6 and o2.num_records == 3
        assert o1.steps.tolist() == [0, 1, 2, 3, 4, 5]
        assert o2.steps.tolist() == [0, 1, 2]
        for row, g in enumerate(head_grads):
            assert torch.equal(o2.param_records["2.weight"].read("grad", row), g)
        assert sorted(run.steps()["optimizer"].unique()) == [0, 1]
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert report.matched == 6 * 2 + 3 * 2
    assert sorted(report.checks["optimizer"].unique()) == [0, 1]


# -- tied parameters ---------------------------------------------------------------------------------------
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.emb = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.emb(tokens))))


def test_tied_parameter_recorded_once(tmp_path):
    path = tmp_path / "tied.h5"
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []
    with upd.record(path, model, opt, every=1):
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            tokens = torch.randint(0, 10, (8,), generator=g)
            target = torch.randint(0, 10, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens), target).backward()
            seen.append(model.emb.weight.grad.clone())
            opt.step()
    with upd.open_run(path) as run:
        assert sorted(run.params()["param"]) == ["emb.weight", "mix.bias", "mix.weight"]
        emb = run.param("emb.weight")
        assert emb.shape == (10, 4) and emb.num_rows == 3
        for row in range(3):
            assert torch.equal(emb.read("grad", row), seen[row])  # both uses' gradients, summed
        assert np.diff(run.optimizers[0].backward_passes).tolist() == [1, 1]
        with h5py.File(path, "r") as f:
            assert sorted(f[schema.PARAMS_GROUP.path(k=0)]) == ["emb.weight", "mix.bias", "mix.weight"]
    assert upd.verify(path).exit_code == 0


# -- names without a model ---------------------------------------------------------------------------------
def test_names_from_optimizer_param_names_without_model(tmp_path):
    path = tmp_path / "named.h5"
    model = mlp(seed=12)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    with upd.record(path, optimizer=opt, every=1):
        train(model, opt, 3)
    with upd.open_run(path) as run:
        assert sorted(run.params()["param"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert torch.equal(run.param("2.weight").read("param_after", 2), model[2].weight.detach())
    assert upd.verify(path).exit_code == 0


def test_names_for_a_plain_parameter_list(tmp_path):
    path = tmp_path / "plain.h5"
    torch.manual_seed(12)
    w = nn.Parameter(torch.randn(3, 4))
    b = nn.Parameter(torch.randn(3))
    c = nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([{"params": [w, b]}, {"params": [c], "lr": 0.01}], lr=0.1)
    x = torch.randn(5, 4)
    with upd.record(path, None, opt, every=1):
        for _ in range(3):
            opt.zero_grad()
            ((x @ w.T + b) * c).pow(2).mean().backward()
            opt.step()
    with upd.open_run(path) as run:
        names = dict(zip(run.params()["param"], run.params()["group"]))
        assert names == {"group0.param0": 0, "group0.param1": 0, "group1.param0": 1}
        assert torch.equal(run.param("group0.param0").read("param_after", 2), w.detach())
        assert torch.equal(run.param("group1.param0").read("param_after", 2), c.detach())
    assert upd.verify(path).exit_code == 0


# -- non-CPU parameters --------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_params_recorded_as_cpu_copies(tmp_path):
    path = tmp_path / "cuda.h5"
    model = mlp(seed=16).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    with upd.record(path, model, opt, every=1):
        for s in range(3):
            opt.zero_grad()
            x, y = batch(s)
            nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
            grads.append({n: p.grad.cpu() for n, p in model.named_parameters()})
            opt.step()
    with upd.open_run(path) as run:
        for name, p in run.optimizers[0].param_records.items():
            for row in range(3):
                assert torch.equal(p.read("grad", row), grads[row][name])
            assert torch.equal(p.read("param_after", 2), params_of(model)[name].cpu())
    assert upd.verify(path).exit_code == 0


def test_each_recorded_step_has_the_hyperparameters_of_its_own_step(tmp_path):
    """Hyperparameter snapshots are reused while a group's values stay the same objects: a value replaced in the
    group (a new betas tuple, a weight decay) shows from its step on, and an lr a scheduler fills in place in a
    tensor is read again at every step."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.AdamW([{"params": first.parameters(), "lr": 0.01, "weight_decay": 0.1},
                             {"params": second.parameters(), "lr": torch.tensor(0.01)}])
    path = str(tmp_path / "run.h5")
    with upd.record(path, nn.Sequential(first, second), opt, every=None, stats_every=1):
        for step in range(6):
            if step == 2:
                opt.param_groups[0]["betas"] = (0.8, 0.9)
            if step == 4:
                opt.param_groups[0]["weight_decay"] = 0.0
            opt.param_groups[1]["lr"].fill_(0.01 * (step + 1))
            opt.zero_grad()
            second(first(torch.randn(3, 4))).pow(2).mean().backward()
            opt.step()
    with upd.open_run(path) as run:
        groups = [run.optimizers[0].step_hparams(step) for step in range(6)]
    assert [tuple(g[0]["betas"]) for g in groups] == [(0.9, 0.999)] * 2 + [(0.8, 0.9)] * 4
    assert [g[0]["weight_decay"] for g in groups] == [0.1] * 4 + [0.0] * 2
    assert [g[1]["lr"] for g in groups] == pytest.approx([0.01 * (s + 1) for s in range(6)])
