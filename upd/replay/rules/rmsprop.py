"""Replay of torch.optim.RMSprop (torch/optim/rmsprop.py: _single_tensor_rmsprop, _multi_tensor_rmsprop).

    g = -grad if maximize else grad;  g += weight_decay * param
    square_avg = alpha * square_avg + (1 - alpha) * g * g
    centered:  grad_avg = lerp(grad_avg, g, 1 - alpha);  avg = sqrt(square_avg - grad_avg^2) + eps
    else:      avg = sqrt(square_avg) + eps
    momentum > 0:  buf = momentum * buf + g / avg;  param -= lr * buf      (buf starts at zero, not at g)
    else:          param -= lr * g / avg

The for-loop, foreach and capturable (tensor lr: ``avg / -lr`` or ``buf * -lr``) paths differ only in float32
rounding; differentiable only avoids in-place ops. No flag changes the replay.
"""
from __future__ import annotations

import torch

from ..registry import Replayed, kept_when, register, zeros


def rmsprop_step(param, grad, square_avg, grad_avg, momentum_buffer, *, lr, alpha, eps, weight_decay,
                 momentum, centered, maximize):
    """One RMSprop step. Returns (param, square_avg, grad_avg or None, momentum_buffer or None)."""
    grad = -grad if maximize else grad
    if weight_decay != 0:
        grad = grad + weight_decay * param
    square_avg = alpha * square_avg + (1 - alpha) * grad * grad
    if centered:
        grad_avg = grad_avg + (grad - grad_avg) * (1 - alpha)  # torch uses lerp_
        avg = (square_avg - grad_avg * grad_avg).sqrt() + eps
    else:
        grad_avg = None
        avg = square_avg.sqrt() + eps
    if momentum > 0:
        momentum_buffer = momentum * momentum_buffer + grad / avg
        param = param - lr * momentum_buffer
    else:
        momentum_buffer = None
        param = param - lr * grad / avg
    return param, square_avg, grad_avg, momentum_buffer


# torch initialises every buffer to zero on the first step
RMSPROP_STATE = {"square_avg": zeros, "grad_avg": kept_when("centered"),
                 "momentum_buffer": kept_when(lambda param, group: group.get("momentum", 0) > 0)}


@register(torch.optim.RMSprop, state=RMSPROP_STATE, counts_steps=True, elementwise=True)
def rmsprop(param, grad, state, group, step):
    new_param, square_avg, grad_avg, momentum_buffer = rmsprop_step(
        param, grad, state["square_avg"], state.get("grad_avg"), state.get("momentum_buffer"), lr=group["lr"],
        alpha=group["alpha"], eps=group["eps"], weight_decay=group.get("weight_decay", 0.0),
        momentum=group.get("momentum", 0), centered=bool(group.get("centered", False)),
        maximize=group.get("maximize", False))
    return Replayed(new_param, {"square_avg": square_avg, "grad_avg": grad_avg, "momentum_buffer": momentum_buffer})
