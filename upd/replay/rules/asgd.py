"""Replay of torch.optim.ASGD (torch/optim/asgd.py: _single_tensor_asgd, _multi_tensor_asgd).

    g = -grad if maximize else grad;  g += weight_decay * param
    param = param * (1 - lambd * eta) - eta * g        (eta, mu: the per-parameter state before the step)
    ax = param if mu == 1 else ax + (param - ax) * mu
    step += 1;  eta = lr / (1 + lambd * lr * step) ** alpha;  mu = 1 / max(1, step - t0)

So this step's update uses the eta computed at the previous step (the group's lr on the first step), and this
step's lr only enters the new eta: a wrong lr shows up in the state compared at the next record.
foreach computes ``param - eta * (g + lambd * param)`` and always averages ax (mu = 1 gives ax = param), and
computes the new eta in float32 from the float32 step tensor (the for-loop in float64 from its value); capturable
does the same with tensors. These are the same math and differ only in float32 rounding: no flag changes the
replay.
"""
from __future__ import annotations

import torch

from ..registry import Replayed, register, require, scalar


def asgd_step(param, grad, ax, eta, mu, step, *, lr, lambd, alpha, t0, weight_decay, maximize):
    """One ASGD step; step counts the steps done before this one, eta and mu are floats. Returns (param, ax,
    new eta, new mu, new step)."""
    grad = -grad if maximize else grad
    step = step + 1
    if weight_decay != 0:
        grad = grad + weight_decay * param
    param = param * (1 - lambd * eta) - eta * grad
    ax = param.clone() if mu == 1 else ax + (param - ax) * mu
    new_eta = lr / ((1 + lambd * lr * step) ** alpha)
    new_mu = 1 / max(1, step - t0)
    return param, ax, new_eta, new_mu, step


@register(torch.optim.ASGD)
def asgd(param, grad, state, group, step):
    lr = scalar(group["lr"])
    if state:
        require(state, ("step", "eta", "mu", "ax"))
        done = int(round(float(state["step"])))
        eta, mu, ax = float(state["eta"]), float(state["mu"]), state["ax"]
    else:  # first step: eta = lr, mu = 1, ax = 0
        done, eta, mu, ax = 0, lr, 1.0, torch.zeros_like(param)
    new_param, new_ax, new_eta, new_mu, new_step = asgd_step(
        param, grad, ax, eta, mu, done, lr=lr, lambd=scalar(group["lambd"]), alpha=scalar(group["alpha"]),
        t0=scalar(group["t0"]), weight_decay=scalar(group.get("weight_decay", 0.0)),
        maximize=group.get("maximize", False))
    f64 = torch.float64
    return Replayed(new_param, {"step": torch.tensor(float(new_step), dtype=f64), "ax": new_ax,
                                "eta": torch.tensor(new_eta, dtype=f64), "mu": torch.tensor(new_mu, dtype=f64)})
