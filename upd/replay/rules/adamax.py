"""Replay of torch.optim.Adamax (torch/optim/adamax.py, _single_tensor_adamax).

The for-loop, foreach and differentiable paths (torch has no fused Adamax) compute the same quantities and differ
only in float32 rounding (the differentiable path takes the infinity norm with ``amax`` over a stacked pair instead
of ``maximum``). The capturable paths fold the bias correction and the lr into the denominator
(``exp_inf * (beta1**t - 1) / lr``) and compute ``beta1**t`` as a float32 tensor power of the float32 step counter,
i.e. with beta1 rounded to float32: that shifts the bias correction by up to ~6e-8 * t / (1 - beta1**t) relative
(1.3e-5 at t=1 for beta = 0.999), far more than float32 rounding of the result, so the replay computes that power
the same way when the recorded group says capturable=True (assuming torch's default float32 step counter).
"""
from __future__ import annotations

import torch

from ..capturable import beta_power
from ..registry import Replayed, register, zeros


def adamax_step(param, grad, exp_avg, exp_inf, step, *, lr, beta1, beta2, eps, weight_decay, maximize,
                capturable=False):
    """One Adamax step; step counts the steps done before this one. Returns (param, exp_avg, exp_inf)."""
    grad = -grad if maximize else grad
    step = step + 1
    if weight_decay != 0:
        grad = grad + weight_decay * param
    exp_avg = exp_avg + (grad - exp_avg) * (1 - beta1)  # torch uses lerp_
    # the exponentially weighted infinity norm: eps is added to |g| before the max, not to the denominator
    exp_inf = torch.maximum(beta2 * exp_inf, grad.abs() + eps)
    bias_correction = 1 - beta_power(beta1, step, float32=capturable)
    param = param - (lr / bias_correction) * exp_avg / exp_inf
    return param, exp_avg, exp_inf


# torch initialises both moments to zero on the first step
@register(torch.optim.Adamax, state={"exp_avg": zeros, "exp_inf": zeros}, counts_steps=True, elementwise=True)
def adamax(param, grad, state, group, step):
    beta1, beta2 = group["betas"]
    new_param, exp_avg, exp_inf = adamax_step(
        param, grad, state["exp_avg"], state["exp_inf"], step, lr=group["lr"], beta1=beta1, beta2=beta2,
        eps=group["eps"], weight_decay=group.get("weight_decay", 0), maximize=group.get("maximize", False),
        capturable=bool(group.get("capturable", False)))
    return Replayed(new_param, {"exp_avg": exp_avg, "exp_inf": exp_inf})
