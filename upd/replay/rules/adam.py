"""Replay of torch.optim.Adam and AdamW (torch/optim/adam.py, _single_tensor_adam)."""
from __future__ import annotations

import torch

from ..registry import Replayed, register, require, scalar


def adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
              amsgrad, maximize, decoupled_weight_decay):
    """One Adam(W) step; step counts the steps done before this one. Returns (param, exp_avg, exp_avg_sq,
    max_exp_avg_sq or None, new step)."""
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
    return param, exp_avg, exp_avg_sq, (max_exp_avg_sq if amsgrad else None), step


@register(torch.optim.Adam)
def adam(param, grad, state, group, step):
    return _replay(param, grad, state, group, decoupled_default=False)


@register(torch.optim.AdamW)
def adamw(param, grad, state, group, step):
    # AdamW is Adam with decoupled_weight_decay=True; older torch versions wrote groups without that key.
    return _replay(param, grad, state, group, decoupled_default=True)


def _replay(param, grad, state, group, *, decoupled_default):
    amsgrad = bool(group.get("amsgrad", False))
    if state:
        require(state, ("exp_avg", "exp_avg_sq", "step") + (("max_exp_avg_sq",) if amsgrad else ()))
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        max_sq = state.get("max_exp_avg_sq")
        done = int(round(float(state["step"])))
    else:  # first step: torch initialises the moments to zero
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        max_sq = torch.zeros_like(param) if amsgrad else None
        done = 0
    beta1, beta2 = group["betas"]
    decoupled = group.get("decoupled_weight_decay", decoupled_default)
    new_param, m, v, vmax, new_step = adam_step(
        param, grad, exp_avg, exp_avg_sq, max_sq, done, lr=scalar(group["lr"]), beta1=scalar(beta1),
        beta2=scalar(beta2), eps=group["eps"], weight_decay=group.get("weight_decay", 0), amsgrad=amsgrad,
        maximize=group.get("maximize", False), decoupled_weight_decay=bool(decoupled))
    new_state = {"step": torch.tensor(float(new_step), dtype=torch.float64), "exp_avg": m, "exp_avg_sq": v}
    if vmax is not None:
        new_state["max_exp_avg_sq"] = vmax
    return Replayed(new_param, new_state)
