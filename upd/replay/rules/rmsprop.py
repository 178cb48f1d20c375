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

from ..registry import Replayed, register, require, scalar


def rmsprop_step(param, grad, square_avg, grad_avg, momentum_buffer, step, *, lr, alpha, eps, weight_decay,
                 momentum, centered, maximize):
    """One RMSprop step; step counts the steps done before this one. Returns (param, square_avg, grad_avg or
    None, momentum_buffer or None, new step)."""
    grad = -grad if maximize else grad
    step = step + 1
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
    return param, square_avg, grad_avg, momentum_buffer, step


@register(torch.optim.RMSprop)
def rmsprop(param, grad, state, group, step):
    momentum = scalar(group.get("momentum", 0))
    centered = bool(group.get("centered", False))
    needed = ("square_avg", "step") + (("momentum_buffer",) if momentum > 0 else ()) + \
        (("grad_avg",) if centered else ())
    if state:
        require(state, needed)
        done = int(round(float(state["step"])))
        square_avg, grad_avg, buf = state["square_avg"], state.get("grad_avg"), state.get("momentum_buffer")
    else:  # first step: torch initialises every buffer to zero
        done = 0
        square_avg = torch.zeros_like(param)
        grad_avg = torch.zeros_like(param) if centered else None
        buf = torch.zeros_like(param) if momentum > 0 else None
    new_param, sq, gavg, new_buf, new_step = rmsprop_step(
        param, grad, square_avg, grad_avg, buf, done, lr=scalar(group["lr"]), alpha=scalar(group["alpha"]),
        eps=scalar(group["eps"]), weight_decay=scalar(group.get("weight_decay", 0.0)), momentum=momentum,
        centered=centered, maximize=group.get("maximize", False))
    new_state = {"step": torch.tensor(float(new_step), dtype=torch.float64), "square_avg": sq}
    if gavg is not None:
        new_state["grad_avg"] = gavg
    if new_buf is not None:
        new_state["momentum_buffer"] = new_buf
    return Replayed(new_param, new_state)
