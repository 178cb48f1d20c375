"""Recorder behaviour on real (tiny) training runs: what ends up in the file, read back with upd and plain h5py.

Every test trains a small nn model with a real torch.optim optimizer for a few deterministic steps, records it, and
asserts concrete values against what the training loop itself saw (gradients, learning rates, parameters).
"""
from __future__ import annotations

import math
import warnings

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.runfile.writer import RunWriter

D_IN, D_HID, D_OUT = 6, 5, 3


# -- helpers ----------------------------------------------------------------------------------------------------
def mlp(seed: int = 0) -> nn.Sequential:
    """Params: 0.weight (5,6), 0.bias (5,), 2.weight (3,5), 2.bias (3,)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_OUT))


def batch(step: int, n: int = 8, d_in: int = D_IN, d_out: int = D_OUT):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def loss_at(model, step: int, **kw) -> torch.Tensor:
    x, y = batch(step, **kw)
    return nn.functional.mse_loss(model(x), y)


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def params_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model, opt, steps: int, before_step=None):
    for s in range(steps):
        opt.zero_grad()
        loss_at(model, s).backward()
        if before_step is not None:
            before_step(s)
        opt.step()


def assert_same_params(a: nn.Module, b: nn.Module):
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert torch.equal(pa, pb), na


def no_hooks_left(opt, model=None) -> bool:
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    if model is not None:
        for p in model.parameters():
            if getattr(p, "_post_accumulate_grad_hooks", None):
                return False
    return True


def steps_col(run, opt_index=0, col="step"):
    df = run.steps
    return df[df["optimizer"] == opt_index][col].tolist()


# -- 1. parameter without a gradient in some steps ----------------------------------------------------------------
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
    with upd.record(path, model, opt):
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


# -- 2. frozen parameters --------------------------------------------------------------------------------------
def _frozen_run(path=None):
    model = mlp(seed=2)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the frozen params are in the optimizer
    if path is None:
        train(model, opt, 4)
    else:
        with upd.record(path, model, opt):
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
        assert sorted(run.params["param"]) == ["2.bias", "2.weight"]
        assert run.params_not_optimized == []  # they are in the optimizer, just frozen
        assert run.optimizers[0].num_records == 4
        assert run.param("2.weight").records.tolist() == [0, 1, 2, 3]
    assert upd.verify(path).exit_code == 0


# -- 3. several param groups ----------------------------------------------------------------------------------
def test_param_groups_with_different_hyperparameters(tmp_path):
    path = tmp_path / "groups.h5"
    model = mlp(seed=3)
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[2].parameters(), "lr": 0.01, "weight_decay": 0.1}], momentum=0.9)
    with upd.record(path, model, opt):
        train(model, opt, 4)
    with upd.open_run(path) as run:
        groups = dict(zip(run.params["param"], run.params["group"]))
        assert groups == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1}
        steps = run.steps
        assert steps["lr_group0"].tolist() == [0.1] * 4
        assert steps["lr_group1"].tolist() == [0.01] * 4
        hp = run.optimizers[0].hparams(2)
        assert hp[0]["weight_decay"] == 0 and hp[1]["weight_decay"] == 0.1
        assert hp[0]["momentum"] == hp[1]["momentum"] == 0.9
    # Replaying with the wrong group's lr / weight decay would not match.
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert report.matched == 16


# -- 4. add_param_group mid-run -------------------------------------------------------------------------------
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
    with upd.record(path, model, opt):
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
        steps = run.steps
        assert steps["lr_group0"].tolist() == [1e-2] * 6
        lr1 = steps["lr_group1"].tolist()
        assert all(math.isnan(v) for v in lr1[:3]) and lr1[3:] == [5e-3] * 3
        assert b.state_at(0) == {}  # fresh state when it joined
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    b_checks = report.checks[report.checks["param"] == "b.weight"]
    assert b_checks["status"].tolist() == ["match"] * 3


# -- 5. two optimizers -----------------------------------------------------------------------------------------
def test_two_optimizers_recorded_together(tmp_path):
    path = tmp_path / "two.h5"
    model = mlp(seed=5)
    opt1 = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    opt2 = torch.optim.Adam(model[2].parameters(), lr=1e-2)
    head_grads = []
    with upd.record(path, model, [opt1, opt2]):
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
        assert sorted(o1.params) == ["0.bias", "0.weight"]
        assert sorted(o2.params) == ["2.bias", "2.weight"]
        assert o1.num_records == 6 and o2.num_records == 3
        assert o1.step.tolist() == [0, 1, 2, 3, 4, 5]
        assert o2.step.tolist() == [0, 1, 2]
        for row, g in enumerate(head_grads):
            assert torch.equal(o2.params["2.weight"].read("grad", row), g)
        assert sorted(run.steps["optimizer"].unique()) == [0, 1]
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert report.matched == 6 * 2 + 3 * 2
    assert sorted(report.checks["optimizer"].unique()) == [0, 1]


# -- 6. LR scheduler --------------------------------------------------------------------------------------------
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
    with upd.record(path, model, opt):
        for s in range(steps):
            opt.zero_grad()
            loss_at(model, s).backward()
            used_lr.append(opt.param_groups[0]["lr"])
            used_betas.append(opt.param_groups[0].get("betas"))
            opt.step()
            sched.step()
    assert len(set(used_lr)) > 2  # the schedule really changed the lr
    with upd.open_run(path) as run:
        assert run.steps["lr_group0"].tolist() == used_lr
        for r in range(steps):
            hp = run.optimizers[0].hparams(r)[0]
            assert hp["lr"] == used_lr[r]
            if kind == "onecycle":
                assert hp["betas"] == list(used_betas[r])
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert report.matched == steps * 4


# -- 7. GradScaler-skipped step ----------------------------------------------------------------------------------
def test_gradscaler_skipped_step_leaves_a_gap_not_a_record(tmp_path):
    path = tmp_path / "amp.h5"
    model = mlp(seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    expected_grads = []
    with upd.record(path, model, opt):
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
        assert o.step.tolist() == [0, 1, 2, 3]
        assert np.diff(o.backward_pass).tolist() == [1, 2, 1]  # the skipped step shows as a jump of 2
        for name, p in o.params.items():
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
    with upd.record(path, model, opt):
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
        assert run.optimizers[0].backward_pass.tolist() == [2, 3, 4]


# -- 8. gradient clipping --------------------------------------------------------------------------------------
def test_gradient_clipping_records_the_clipped_grad(tmp_path):
    path = tmp_path / "clip.h5"
    model = mlp(seed=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    max_norm = 0.05
    clipped, norms = [], []

    def clip(_s):
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        clipped.append(grads_of(model))

    with upd.record(path, model, opt):
        train(model, opt, 4, before_step=clip)
    assert min(norms) > max_norm  # clipping really changed every step's gradient
    with upd.open_run(path) as run:
        for row in range(4):
            total = 0.0
            for name, p in run.optimizers[0].params.items():
                g = p.read("grad", row)
                assert torch.equal(g, clipped[row][name])
                total += float(g.double().pow(2).sum())
            assert math.sqrt(total) <= max_norm * (1 + 1e-5)
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


# -- 9. gradient accumulation ------------------------------------------------------------------------------------
def test_gradient_accumulation_one_record_per_step(tmp_path):
    path = tmp_path / "accum.h5"
    model = mlp(seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accum, steps = 3, 4
    expected = []
    with upd.record(path, model, opt):
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
        assert o.step.tolist() == list(range(steps))
        assert np.diff(o.backward_pass).tolist() == [accum] * (steps - 1)
        for name, p in o.params.items():
            assert p.rows == steps
            for row in range(steps):
                torch.testing.assert_close(p.read("grad", row), expected[row][name], rtol=1e-6, atol=1e-8)
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


# -- 10. NaN / Inf in a gradient ---------------------------------------------------------------------------------
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

    with upd.record(path, model, opt):
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


# -- 11. tied parameters ---------------------------------------------------------------------------------------
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
    with upd.record(path, model, opt):
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            tokens = torch.randint(0, 10, (8,), generator=g)
            target = torch.randint(0, 10, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens), target).backward()
            seen.append(model.emb.weight.grad.clone())
            opt.step()
    with upd.open_run(path) as run:
        assert sorted(run.params["param"]) == ["emb.weight", "mix.bias", "mix.weight"]
        emb = run.param("emb.weight")
        assert emb.shape == (10, 4) and emb.rows == 3
        for row in range(3):
            assert torch.equal(emb.read("grad", row), seen[row])  # both uses' gradients, summed
        assert np.diff(run.optimizers[0].backward_pass).tolist() == [1, 1]
        with h5py.File(path, "r") as f:
            assert sorted(f["optimizers/0/params"]) == ["emb.weight", "mix.bias", "mix.weight"]
    assert upd.verify(path).exit_code == 0


# -- 12. names without a model ---------------------------------------------------------------------------------
def test_names_from_optimizer_param_names_without_model(tmp_path):
    path = tmp_path / "named.h5"
    model = mlp(seed=12)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    with upd.record(path, optimizer=opt):
        train(model, opt, 3)
    with upd.open_run(path) as run:
        assert sorted(run.params["param"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
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
    with upd.record(path, None, opt):
        for _ in range(3):
            opt.zero_grad()
            ((x @ w.T + b) * c).pow(2).mean().backward()
            opt.step()
    with upd.open_run(path) as run:
        names = dict(zip(run.params["param"], run.params["group"]))
        assert names == {"group0.param0": 0, "group0.param1": 0, "group1.param0": 1}
        assert torch.equal(run.param("group0.param0").read("param_after", 2), w.detach())
        assert torch.equal(run.param("group1.param0").read("param_after", 2), c.detach())
    assert upd.verify(path).exit_code == 0


# -- 13. options: every, include/exclude, what, dtype, compression --------------------------------------------------
def test_every_n_records_every_nth_step(tmp_path):
    path = tmp_path / "every.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = []
    with upd.record(path, model, opt, every=3):
        train(model, opt, 7, before_step=lambda s: before.append(params_of(model)))
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.step.tolist() == [0, 3, 6]
        assert np.diff(o.backward_pass).tolist() == [3, 3]
        p = o.params["0.weight"]
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
    with upd.record(path, model, opt, include=include, exclude=exclude):
        train(model, opt, 2)
    with upd.open_run(path) as run:
        assert sorted(run.params["param"]) == expected
        assert run.optimizers[0].num_records == 2
    assert upd.verify(path).exit_code == 0


def test_what_param_only_has_no_grad_or_state_and_is_not_verifiable(tmp_path):
    path = tmp_path / "what.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(path, model, opt, what=("param",)):
        train(model, opt, 3)
    with h5py.File(path, "r") as f:
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            grp = f[f"optimizers/0/params/{name}"]
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
    with upd.record(path, model, opt, what=("param", "grad")):
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

    with upd.record(path, model, opt, dtype=dtype):
        train(model, opt, 4, before_step=snap)
    target = getattr(torch, dtype)
    with upd.open_run(path) as run:
        for name, p in run.optimizers[0].params.items():
            assert p.storage_dtype("param") == dtype and p.dtype == "float32"
            for row in range(4):
                stored = p.read("param", row)
                assert stored.dtype == target
                assert torch.equal(stored, before[row][name].to(target))
                assert torch.equal(p.read("grad", row), grads[row][name].to(target))
            assert torch.equal(p.read("param_after", 3), params_of(model)[name].to(target))
    with h5py.File(path, "r") as f:
        ds = f["optimizers/0/params/0.weight/param"]
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
    with upd.record(path, model, opt, dtype="float16"):
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
    with upd.record(path, model, opt, dtype="bfloat16"):
        train(model, opt, 3)
    with upd.open_run(path) as run:
        assert run.optimizers[0].step.tolist() == [300, 301, 302]
        p = run.param("0.weight")
        assert [float(p.state_at(row)["step"]) for row in range(3)] == [300.0, 301.0, 302.0]


def test_gzip_compression(tmp_path):
    path = tmp_path / "gzip.h5"
    model = mlp(seed=13)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    with upd.record(path, model, opt, compression="gzip"):
        train(model, opt, 3, before_step=lambda s: grads.append(grads_of(model)))
    with h5py.File(path, "r") as f:
        grp = f["optimizers/0/params/0.weight"]
        for kind in ("param", "grad", "param_after", "state/exp_avg"):
            assert grp[kind].compression == "gzip", kind
        np.testing.assert_array_equal(grp["grad"][1], grads[1]["0.weight"].numpy())
    assert upd.verify(path).exit_code == 0


# -- 14. overwrite, and every hook removed on close -----------------------------------------------------------------
def test_refuses_to_overwrite_unless_asked(tmp_path):
    path = tmp_path / "exists.h5"
    path.write_bytes(b"precious")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FileExistsError):
        upd.record(path, model, opt)
    assert path.read_bytes() == b"precious"
    assert no_hooks_left(opt, model)
    with upd.record(path, model, opt, overwrite=True):
        train(model, opt, 2)
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 2


def test_with_block_removes_every_hook(tmp_path):
    path = tmp_path / "hooks.h5"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt) as rec:
        train(model, opt, 2)
        assert opt._optimizer_step_pre_hooks and opt._optimizer_step_post_hooks
    assert not rec.active
    assert no_hooks_left(opt, model)
    train(model, opt, 3)  # training after close adds nothing
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 2
        assert run.param("0.weight").rows == 2


def test_explicit_close_removes_every_hook(tmp_path):
    path = tmp_path / "close.h5"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = upd.record(path, model, opt)
    train(model, opt, 3)
    assert rec.records == 3
    rec.close()
    rec.close()  # twice is fine
    assert no_hooks_left(opt, model)
    train(model, opt, 2)
    assert rec.records == 3
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 3


# -- 15. recorder errors never kill training ------------------------------------------------------------------------
def _failing_write(monkeypatch, fail_on_call: int):
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
        with upd.record(path, model, opt) as rec:
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
        assert run.optimizers[0].step.tolist() == [0, 1]
        assert run.param("0.weight").rows == 2
    assert upd.verify(path).exit_code == 0


def test_error_in_the_middle_of_a_record_leaves_only_committed_records(tmp_path, monkeypatch):
    path = tmp_path / "partial.h5"
    real = RunWriter._write_tensor
    calls = {"n": 0}
    per_record = 4 * 3  # SGD without momentum: param, grad, param_after for each of the 4 params

    def write_tensor(self, ds, row, tensor):
        calls["n"] += 1
        if calls["n"] == 2 * per_record + 5:  # record 2, second parameter: some of its rows are on disk
            raise OSError("No space left on device")
        return real(self, ds, row, tensor)

    monkeypatch.setattr(RunWriter, "_write_tensor", write_tensor)
    model = mlp(seed=15)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(upd.RecorderWarning, match="No space left on device"):
        with upd.record(path, model, opt):
            train(model, opt, 4)
    with h5py.File(path, "r") as f:
        assert f["optimizers/0/records/step"].shape == (2,)
        assert f["optimizers/0/params/0.weight/param"].shape[0] == 3  # a row of the uncommitted record exists
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.num_records == 2
        for p in o.params.values():
            assert p.records.tolist() == [0, 1]  # the uncommitted record is invisible
    report = upd.verify(path)
    assert report.exit_code == 0 and report.matched == 2 * 4


def test_write_error_with_strict_propagates(tmp_path, monkeypatch):
    path = tmp_path / "strict.h5"
    _failing_write(monkeypatch, fail_on_call=2)
    model = mlp(seed=15)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OSError, match="No space left on device"):
        with upd.record(path, model, opt, strict=True):
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
        with upd.record(path, model, opt):
            opt.register_step_post_hook(lambda o, a, k: user_calls.append(1))  # e.g. an EMA or a logger
            train(model, opt, 4)  # must not raise
    assert len(user_calls) == 4


# -- 16. non-CPU parameters --------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_params_recorded_as_cpu_copies(tmp_path):
    path = tmp_path / "cuda.h5"
    model = mlp(seed=16).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    with upd.record(path, model, opt):
        for s in range(3):
            opt.zero_grad()
            x, y = batch(s)
            nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
            grads.append({n: p.grad.cpu() for n, p in model.named_parameters()})
            opt.step()
    with upd.open_run(path) as run:
        for name, p in run.optimizers[0].params.items():
            for row in range(3):
                assert torch.equal(p.read("grad", row), grads[row][name])
            assert torch.equal(p.read("param_after", 2), params_of(model)[name].cpu())
    assert upd.verify(path).exit_code == 0


# -- the seed answer, reproduced from the file with plain h5py -------------------------------------------------------
def test_seed_answer_adam_step_recomputed_by_hand_from_plain_h5py(tmp_path):
    path = tmp_path / "seed.h5"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 10)
    with upd.record(path, model, opt):
        for _ in range(5):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    step = 2
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    with h5py.File(path, "r") as f:
        assert list(f["optimizers/0/records/step"][()]) == [0, 1, 2, 3, 4]
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            grp = f[f"optimizers/0/params/{name}"]
            records = list(grp["record"][()])
            row, nxt = records.index(step), records.index(step + 1)
            w = torch.from_numpy(grp["param"][row])
            g = torch.from_numpy(grp["grad"][row])
            m_old = torch.from_numpy(grp["state/exp_avg"][row])
            v_old = torch.from_numpy(grp["state/exp_avg_sq"][row])
            assert float(grp["state/step"][row]) == step
            m = b1 * m_old + (1 - b1) * g
            v = b2 * v_old + (1 - b2) * g.pow(2)
            m_hat = m.div(1 - b1 ** (step + 1))
            v_hat = v.div(1 - b2 ** (step + 1))
            w_new = w - lr * m_hat / (torch.sqrt(v_hat) + eps)
            assert torch.allclose(w_new, torch.from_numpy(grp["param"][nxt])), name
            assert torch.allclose(w_new, torch.from_numpy(grp["param_after"][row])), name
            # and the update is not trivially small compared with allclose's tolerance
            assert not torch.allclose(w, w_new, rtol=0, atol=1e-5), name
