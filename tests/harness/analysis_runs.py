"""Real little runs for the analysis' tests: a deep stack of layers (more weights than a line plot can show, and
names whose alphabetical order differs from the model's), a schedule, and the loss logged with rec.log."""
from __future__ import annotations

import torch
from torch import nn

import upd

WIDTH = 8


def deep_model(n_layers: int, init_scale: float | None = None, seed: int = 0) -> nn.Sequential:
    """n_layers Linear(8, 8) + Tanh blocks and a Linear(8, 2): weights 0.weight, 2.weight, ..., in that order.
    init_scale: the hidden weights drawn as init_scale * randn (a bad init when small); default: torch's."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, 2))
    model = nn.Sequential(*layers)
    if init_scale is not None:
        with torch.no_grad():
            for m in model[:-1]:
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, init_scale)
    return model


def record_deep(path, *, n_layers: int = 12, steps: int = 6, lr: float = 0.05, init_scale: float | None = None,
                log_loss: bool = True, seed: int = 0, step_size: int = 3, **record_options) -> str:
    """Record `steps` SGD steps of deep_model with a StepLR (lr / 10 every step_size steps), logging the loss."""
    model = deep_model(n_layers, init_scale, seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=0.1)
    g = torch.Generator().manual_seed(seed)
    with upd.record(path, model, opt, overwrite=True, **{"every": 1, **record_options}) as rec:
        for _ in range(steps):
            x = torch.randn(16, WIDTH, generator=g)
            loss = nn.functional.mse_loss(model(x), x[:, :2])
            opt.zero_grad()
            loss.backward()
            if log_loss:
                rec.log(loss=loss)
            opt.step()
            sched.step()
    return str(path)
