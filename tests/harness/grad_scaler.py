"""Mixed-precision training loops with ``torch.amp.GradScaler`` on CPU (float32 weights: the scale mechanism is
the same as under fp16 autocast), recorded by torch-upd, and the same loop without a scaler to compare against."""
from __future__ import annotations

import torch
from torch import nn

import upd

from .training import MLP

SCALE = 2.0 ** 10  # a power of two, as GradScaler's always are: the unscaled gradients are exact


def train(path, *, scaler: bool, fused: bool, unscale: bool = False, inf_steps=(), steps: int = 4,
          optimizer=torch.optim.AdamW, **record_options) -> str:
    """`steps` steps of an MLP with `optimizer` (fused or foreach), under a GradScaler of scale SCALE when `scaler`,
    calling ``scaler.unscale_`` before the step when `unscale`, with an inf written into one gradient at each step
    of `inf_steps` (the scaler then skips that step). Returns path."""
    torch.manual_seed(0)
    model = MLP()
    opt = optimizer(model.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": True}))
    # growth_interval: the scale stays SCALE between the skipped steps (it halves at each)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10_000) if scaler else None
    g = torch.Generator().manual_seed(0)
    with upd.record(path, model, opt, strict=True, **{"every": 1, **record_options}):
        for step in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if grad_scaler is None:
                loss.backward()
                opt.step()
                continue
            grad_scaler.scale(loss).backward()
            if step in inf_steps:
                model.fc1.weight.grad[0, 0] = float("inf")
            if unscale:
                grad_scaler.unscale_(opt)
            grad_scaler.step(opt)
            grad_scaler.update()
    return path
