"""Little models and real training loops that tests record: real torch.optim optimizers on real (tiny) models.

Two families, for two kinds of test:
- `MLP` + `train_steps` (+ `record_run`): a 16-12-4 network on random regression data drawn from a seed, for tests
  that need some real run and check what the file or a command makes of it.
- `mlp` + `train` (+ `batch`, `loss_at`): a 6-5-3 `nn.Sequential` whose batch depends only on the step number, for
  tests that recompute what the training loop itself saw (gradients, parameters) and compare it with the file.
"""
from __future__ import annotations

import torch
from torch import nn

import upd


class MLP(nn.Module):
    def __init__(self, n_in=16, n_hidden=12, n_out=4):
        super().__init__()
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.fc2 = nn.Linear(n_hidden, n_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def train_steps(model, optimizer, steps=4, seed=0, n_in=16, n_out=4, after_step=None, scheduler=None):
    """A real little training loop on random regression data."""
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(8, n_in, generator=g)
        y = torch.randn(8, n_out, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(i)


def record_run(path, make_optimizer, steps=4, seed=0, **record_options):
    """Record `steps` steps of an MLP with the optimizer `make_optimizer(model)` returns; returns path."""
    torch.manual_seed(seed)
    model = MLP()
    optimizer = make_optimizer(model)
    with upd.record(path, model, optimizer, **{"every": 1, **record_options}):
        train_steps(model, optimizer, steps=steps, seed=seed)
    return path


# -- a model and loop whose every batch is known, to compare the file with what training saw ----------------------
D_IN, D_HID, D_OUT = 6, 5, 3


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


def train(model, opt, steps: int, before_step=None):
    """`steps` optimizer steps on `batch(0)`, `batch(1)`, ...; `before_step(s)` runs between backward and step."""
    for s in range(steps):
        opt.zero_grad()
        loss_at(model, s).backward()
        if before_step is not None:
            before_step(s)
        opt.step()


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def params_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a: nn.Module, b: nn.Module):
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert torch.equal(pa, pb), na


def no_hooks_left(opt, model=None) -> bool:
    """True when neither the optimizer nor the model's parameters carry a hook (the recorder removed all of its)."""
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    if model is not None:
        for p in model.parameters():
            if getattr(p, "_post_accumulate_grad_hooks", None):
                return False
    return True
