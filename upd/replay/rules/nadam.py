"""Replay of torch.optim.NAdam (torch/optim/nadam.py, _single_tensor_nadam).

The for-loop, foreach and differentiable paths (torch has no fused NAdam) compute the same quantities and differ
only in float32 rounding: the for-loop path takes ``sqrt(v / bc2)``, foreach ``sqrt(v) / sqrt(bc2)``. The capturable
paths compute their scalars as float32 tensor arithmetic on the float32 step counter: the momentum schedule mu_t
and, with beta2 rounded to float32, ``beta2**t`` -- which moves bias_correction2 = 1 - beta2**t by ~6e-8 * t /
(1 - beta2**t) relative (1.3e-5 at t=1 for beta2 = 0.999; measured: 0.94x the default tolerance when replayed in
double). The replay computes those scalars the same way when the recorded group says capturable=True (assuming
torch's default float32 step counter).

State: ``step``, ``mu_product`` (the running product of the momentum schedule, prod_{i<=t} mu_i, starting at 1),
``exp_avg``, ``exp_avg_sq``.
"""
from __future__ import annotations

import torch

from ..capturable import beta_power, step_scalar
from ..registry import Replayed, register, zeros


def momentum_schedule(step, beta1, momentum_decay, *, float32=False):
    """NAdam's mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay)), in Python double or (capturable paths) in
    float32 tensor arithmetic on the step counter."""
    t = step_scalar(step, float32)
    return float(beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay))))


def nadam_step(param, grad, exp_avg, exp_avg_sq, mu_product, step, *, lr, beta1, beta2, eps, weight_decay,
               momentum_decay, decoupled_weight_decay, maximize, capturable=False):
    """One NAdam step; step counts the steps done before this one, mu_product is the product of mu_1..mu_step.
    Returns (param, exp_avg, exp_avg_sq, new mu_product)."""
    grad = -grad if maximize else grad
    step = step + 1
    bias_correction2 = 1 - beta_power(beta2, step, float32=capturable)
    if weight_decay != 0:
        if decoupled_weight_decay:
            param = param * (1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
    mu = momentum_schedule(step, beta1, momentum_decay, float32=capturable)
    mu_next = momentum_schedule(step + 1, beta1, momentum_decay, float32=capturable)
    mu_product = mu_product * mu
    mu_product_next = mu_product * mu_next
    exp_avg = exp_avg + (grad - exp_avg) * (1 - beta1)  # torch uses lerp_
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denom = (exp_avg_sq / bias_correction2).sqrt() + eps
    # Nesterov momentum: the current gradient weighted by (1 - mu_t), the updated first moment by mu_{t+1}
    param = param - (lr * (1.0 - mu) / (1.0 - mu_product)) * grad / denom
    param = param - (lr * mu_next / (1.0 - mu_product_next)) * exp_avg / denom
    return param, exp_avg, exp_avg_sq, mu_product


# first step: zero moments, empty product
NADAM_STATE = {"exp_avg": zeros, "exp_avg_sq": zeros, "mu_product": lambda param, group: 1.0}


@register(torch.optim.NAdam, state=NADAM_STATE, counts_steps=True, elementwise=True)
def nadam(param, grad, state, group, step):
    beta1, beta2 = group["betas"]
    new_param, exp_avg, exp_avg_sq, mu_product = nadam_step(
        param, grad, state["exp_avg"], state["exp_avg_sq"], float(state["mu_product"]), step, lr=group["lr"],
        beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group.get("weight_decay", 0),
        momentum_decay=group.get("momentum_decay", 4e-3),
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
        maximize=group.get("maximize", False), capturable=bool(group.get("capturable", False)))
    return Replayed(new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "mu_product": mu_product})
