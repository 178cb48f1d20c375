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

from ..registry import Replayed, register, zeros


def adadelta_step(param, grad, square_avg, acc_delta, *, lr, rho, eps, weight_decay, maximize):
    """One Adadelta step. Returns (param, square_avg, acc_delta)."""
    grad = -grad if maximize else grad
    if weight_decay != 0:
        grad = grad + weight_decay * param
    square_avg = rho * square_avg + (1 - rho) * grad * grad
    std = (square_avg + eps).sqrt()
    delta = (acc_delta + eps).sqrt() / std * grad
    acc_delta = rho * acc_delta + (1 - rho) * delta * delta
    return param - lr * delta, square_avg, acc_delta


# torch initialises both averages to zero on the first step
@register(torch.optim.Adadelta, state={"square_avg": zeros, "acc_delta": zeros}, counts_steps=True, elementwise=True)
def adadelta(param, grad, state, group, step):
    new_param, square_avg, acc_delta = adadelta_step(
        param, grad, state["square_avg"], state["acc_delta"], lr=group["lr"], rho=group["rho"], eps=group["eps"],
        weight_decay=group.get("weight_decay", 0.0), maximize=group.get("maximize", False))
    return Replayed(new_param, {"square_avg": square_avg, "acc_delta": acc_delta})
