"""Replay of torch.optim.Adadelta (torch/optim/adadelta.py: _single_tensor_adadelta, _multi_tensor_adadelta).

    g = -grad if maximize else grad;  g += weight_decay * param
    square_avg = rho * square_avg + (1 - rho) * g * g
    delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
    acc_delta = rho * acc_delta + (1 - rho) * delta * delta
    param -= lr * delta

The for-loop, foreach and capturable (tensor lr: ``deltas * -lr`` then add) paths differ only in float32
rounding; differentiable only clones. No flag changes the replay.
"""
from __future__ import annotations

import torch

from ..registry import Replayed, register, require, scalar


def adadelta_step(param, grad, square_avg, acc_delta, step, *, lr, rho, eps, weight_decay, maximize):
    """One Adadelta step; step counts the steps done before this one. Returns (param, square_avg, acc_delta,
    new step)."""
    grad = -grad if maximize else grad
    step = step + 1
    if weight_decay != 0:
        grad = grad + weight_decay * param
    square_avg = rho * square_avg + (1 - rho) * grad * grad
    std = (square_avg + eps).sqrt()
    delta = (acc_delta + eps).sqrt() / std * grad
    acc_delta = rho * acc_delta + (1 - rho) * delta * delta
    return param - lr * delta, square_avg, acc_delta, step


@register(torch.optim.Adadelta)
def adadelta(param, grad, state, group, step):
    if state:
        require(state, ("square_avg", "acc_delta", "step"))
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]
        done = int(round(float(state["step"])))
    else:  # first step: torch initialises both averages to zero
        square_avg, acc_delta = torch.zeros_like(param), torch.zeros_like(param)
        done = 0
    new_param, sq, acc, new_step = adadelta_step(
        param, grad, square_avg, acc_delta, done, lr=scalar(group["lr"]), rho=scalar(group["rho"]),
        eps=scalar(group["eps"]), weight_decay=scalar(group.get("weight_decay", 0.0)),
        maximize=group.get("maximize", False))
    return Replayed(new_param, {"step": torch.tensor(float(new_step), dtype=torch.float64), "square_avg": sq,
                                "acc_delta": acc})
