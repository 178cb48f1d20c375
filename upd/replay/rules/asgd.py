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

from ..registry import Replayed, register, zeros


def asgd_step(param, grad, ax, eta, mu, step, *, lr, lambd, alpha, t0, weight_decay, maximize):
    """One ASGD step; step counts the steps done before this one, eta and mu are floats. Returns (param, ax,
    new eta, new mu)."""
    grad = -grad if maximize else grad
    step = step + 1
    if weight_decay != 0:
        grad = grad + weight_decay * param
    param = param * (1 - lambd * eta) - eta * grad
    ax = param.clone() if mu == 1 else ax + (param - ax) * mu
    new_eta = lr / ((1 + lambd * lr * step) ** alpha)
    new_mu = 1 / max(1, step - t0)
    return param, ax, new_eta, new_mu


# first step: eta = lr, mu = 1, ax = 0
ASGD_STATE = {"eta": lambda param, group: group["lr"], "mu": lambda param, group: 1.0, "ax": zeros}


@register(torch.optim.ASGD, state=ASGD_STATE, counts_steps=True, elementwise=True)
def asgd(param, grad, state, group, step):
    new_param, ax, eta, mu = asgd_step(
        param, grad, state["ax"], float(state["eta"]), float(state["mu"]), step, lr=group["lr"],
        lambd=group["lambd"], alpha=group["alpha"], t0=group["t0"], weight_decay=group.get("weight_decay", 0.0),
        maximize=group.get("maximize", False))
    return Replayed(new_param, {"ax": ax, "eta": eta, "mu": mu})
