"""Replay of torch.optim.Adam and AdamW (torch/optim/adam.py, _single_tensor_adam)."""
from __future__ import annotations

import torch

from ..registry import Replayed, kept_when, register, zeros


def adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
              amsgrad, maximize, decoupled_weight_decay):
    """One Adam(W) step; step counts the steps done before this one. Returns (param, exp_avg, exp_avg_sq,
    max_exp_avg_sq or None)."""
    grad = -grad if maximize else grad
    step = step + 1
    if weight_decay != 0:
        if decoupled_weight_decay:
            param = param * (1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
    exp_avg = exp_avg + (grad - exp_avg) * (1 - beta1)  # torch uses lerp_
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    if amsgrad:
        max_exp_avg_sq = torch.maximum(max_exp_avg_sq, exp_avg_sq)
        second = max_exp_avg_sq
    else:
        second = exp_avg_sq
    denom = second.sqrt() / bias_correction2**0.5 + eps
    param = param - (lr / bias_correction1) * exp_avg / denom
    return param, exp_avg, exp_avg_sq, (max_exp_avg_sq if amsgrad else None)


# torch initialises the moments to zero on the first step
ADAM_STATE = {"exp_avg": zeros, "exp_avg_sq": zeros, "max_exp_avg_sq": kept_when("amsgrad")}


@register(torch.optim.Adam, state=ADAM_STATE, counts_steps=True, elementwise=True)
def adam(param, grad, state, group, step):
    return _replay(param, grad, state, group, step, decoupled_default=False)


@register(torch.optim.AdamW, state=ADAM_STATE, counts_steps=True, elementwise=True)
def adamw(param, grad, state, group, step):
    # AdamW is Adam with decoupled_weight_decay=True; older torch versions wrote groups without that key.
    return _replay(param, grad, state, group, step, decoupled_default=True)


def _replay(param, grad, state, group, step, *, decoupled_default):
    beta1, beta2 = group["betas"]
    new_param, m, v, vmax = adam_step(
        param, grad, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq"), step, lr=group["lr"],
        beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group.get("weight_decay", 0),
        amsgrad=bool(group.get("amsgrad", False)), maximize=group.get("maximize", False),
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", decoupled_default)))
    return Replayed(new_param, {"exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": vmax})
