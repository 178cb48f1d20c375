"""step(closure) optimizers (LBFGS) compute gradients inside step(): the recorder captures them faithfully."""
import torch
from torch import nn

import upd

from tests.harness.training import loss_at, mlp


def test_lbfgs_records_first_gradient_and_every_closure_loss(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(16, 5), torch.randn(16, 2)
    losses, first_grads, befores = [], [], []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses[-1].append(loss.item())
        if len(losses[-1]) == 1:
            first_grads.append(model.weight.grad.clone())
        return loss

    path = str(tmp_path / "lbfgs.h5")
    with upd.record(path, model, opt, every=1):
        for _ in range(3):
            losses.append([])
            befores.append(model.weight.detach().clone())
            opt.step(closure)  # positional closure
        losses.append([])
        befores.append(model.weight.detach().clone())
        opt.step(closure=closure)  # keyword closure
    with upd.open_run(path) as run:
        o = run.optimizers[0]
        assert o.num_records == 4
        w = run.param("weight")
        for row in range(4):
            assert o.closure_losses(row) == losses[row]
            assert torch.equal(w.read("grad", row), first_grads[row])
            assert torch.equal(w.read("param", row), befores[row])
        assert torch.equal(w.read("param_after", 3), model.weight.detach())
        assert len(losses[0]) == 4  # LBFGS really evaluated the model several times in one step
    report = upd.verify(path)
    assert report.exit_code == 3 and "LBFGS" in report.checks["note"].iloc[0]


def test_plain_steps_have_no_closure_losses(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "sgd.h5")
    with upd.record(path, model, opt, every=1):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    with upd.open_run(path) as run:
        assert run.optimizers[0].closure_losses(0) is None


def test_backward_pass_counts_the_closures_backward(tmp_path):
    """step(closure) runs its backward inside step(), after the pre-hook: the record counts it all the same, as a
    plain step would have counted the same backward done before step() (gradient accumulation of 2 here, the
    second micro-batch's backward inside the closure, as Lightning's automatic optimization does)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "closure.h5")
    with upd.record(path, model, opt, every=1):
        for s in range(3):
            opt.zero_grad()
            loss_at(model, 2 * s).backward()

            def closure(s=s):
                loss = loss_at(model, 2 * s + 1)
                loss.backward()
                return loss
            opt.step(closure)
    with upd.open_run(path) as run:
        assert list(run.steps()["backward_pass"]) == [2, 4, 6]
    assert upd.verify(path).exit_code == 0


def test_backward_pass_of_an_lbfgs_step_is_that_of_its_recorded_gradient(tmp_path):
    """LBFGS evaluates the closure several times per step; the record holds the first evaluation's gradient, and
    counts the backward passes up to that one."""
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    evaluations = []

    def closure():
        opt.zero_grad()
        loss = loss_at(model, 0)
        loss.backward()
        evaluations[-1] += 1
        return loss

    path = str(tmp_path / "lbfgs.h5")
    with upd.record(path, model, opt, every=1):
        for _ in range(3):
            evaluations.append(0)
            opt.step(closure)
    with upd.open_run(path) as run:
        assert list(run.steps()["backward_pass"]) == [sum(evaluations[:s]) + 1 for s in range(3)]
    assert evaluations[0] > 1
