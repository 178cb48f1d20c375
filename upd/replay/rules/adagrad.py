"""Replay of torch.optim.Adagrad (torch/optim/adagrad.py: _single_tensor_adagrad, _multi_tensor_adagrad, and the
fused CPU kernel aten/src/ATen/native/cpu/FusedAdagradKernel.cpp).

The three implementations compute the same math:

    g = -grad if maximize else grad;  g += weight_decay * param
    clr = lr / (1 + (step - 1) * lr_decay)          (step counted after this step's increment)
    sum += g * g;  param -= clr * g / (sqrt(sum) + eps)

They differ only in float32 rounding (foreach rounds ``g * -clr`` before the division; fused casts clr, eps and
weight_decay to the parameter dtype), which the default tolerance covers, so no flag changes the replay.

Sparse gradients (nn.Embedding(sparse=True)) are recorded densified: the dense formula leaves the untouched
elements unchanged (their gradient is 0), exactly like torch's sparse path, as long as sqrt(sum) + eps > 0.
"""
from __future__ import annotations

import torch

from ..registry import Replayed, register


def adagrad_step(param, grad, state_sum, step, *, lr, lr_decay, weight_decay, eps, maximize):
    """One Adagrad step; step counts the steps done before this one. Returns (param, state_sum)."""
    grad = -grad if maximize else grad
    step = step + 1
    if weight_decay != 0:
        grad = grad + weight_decay * param
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum = state_sum + grad * grad
    std = state_sum.sqrt() + eps
    return param - clr * grad / std, state_sum


def _initial_sum(param, group):
    # Adagrad creates its state in __init__, so a recorded first step has it; it is empty when the state was not
    # recorded, or for a group added later (created on its first step, with step 0). torch fills "sum" with the
    # constructor's initial_accumulator_value (self.defaults), which is also each group's value unless the group
    # was given its own (which torch ignores, and this replay cannot see).
    return torch.full_like(param, group.get("initial_accumulator_value", 0.0))


@register(torch.optim.Adagrad, state={"sum": _initial_sum}, counts_steps=True, elementwise=True)
def adagrad(param, grad, state, group, step):
    new_param, state_sum = adagrad_step(
        param, grad, state["sum"], step, lr=group["lr"], lr_decay=group.get("lr_decay", 0.0),
        weight_decay=group.get("weight_decay", 0.0), eps=group["eps"], maximize=group.get("maximize", False))
    return Replayed(new_param, {"sum": state_sum})
