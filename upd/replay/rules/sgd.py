"""Replay of torch.optim.SGD (torch/optim/sgd.py, _single_tensor_sgd)."""
from __future__ import annotations

import torch

from ..registry import Replayed, register


def sgd_step(param, grad, momentum_buffer, *, lr, momentum, dampening, weight_decay, nesterov, maximize):
    """One SGD step. Returns (new_param, new_momentum_buffer or None)."""
    grad = -grad if maximize else grad
    if weight_decay != 0:
        grad = grad + weight_decay * param
    buf = None
    if momentum != 0:
        # torch starts the buffer as a plain copy of the first gradient (no dampening on step one)
        buf = grad.clone() if momentum_buffer is None else momentum * momentum_buffer + (1 - dampening) * grad
        grad = grad + momentum * buf if nesterov else buf
    return param - lr * grad, buf


@register(torch.optim.SGD, elementwise=True)
def sgd(param, grad, state, group, step):
    new_param, buf = sgd_step(param, grad, state.get("momentum_buffer"), lr=group["lr"],
                              momentum=group.get("momentum", 0), dampening=group.get("dampening", 0),
                              weight_decay=group.get("weight_decay", 0), nesterov=group.get("nesterov", False),
                              maximize=group.get("maximize", False))
    return Replayed(new_param, {"momentum_buffer": buf})  # None (no momentum): torch keeps no buffer
