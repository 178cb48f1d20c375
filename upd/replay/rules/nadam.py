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

from ..registry import Replayed, register, require, scalar


def _stepscalar(step, float32):
    return torch.tensor(float(step), dtype=torch.float32) if float32 else step


def momentum_schedule(step, beta1, momentum_decay, *, float32=False):
    """NAdam's mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay)), in Python double or (capturable paths) in
    float32 tensor arithmetic on the step counter."""
    t = _stepscalar(step, float32)
    return float(beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay))))


def beta_power(beta, step, *, float32=False):
    """beta ** step in Python double, or (capturable paths) as torch's float32 tensor power of the step counter."""
    return float(beta ** _stepscalar(step, float32))


def nadam_step(param, grad, exp_avg, exp_avg_sq, mu_product, step, *, lr, beta1, beta2, eps, weight_decay,
               momentum_decay, decoupled_weight_decay, maximize, capturable=False):
    """One NAdam step; step counts the steps done before this one, mu_product is the product of mu_1..mu_step.
    Returns (param, exp_avg, exp_avg_sq, new mu_product, new step)."""
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
    return param, exp_avg, exp_avg_sq, mu_product, step


@register(torch.optim.NAdam)
def nadam(param, grad, state, group, step):
    if state:
        require(state, ("exp_avg", "exp_avg_sq", "mu_product", "step"))
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        mu_product = float(state["mu_product"])
        done = int(round(float(state["step"])))
    else:  # first step: zero moments, empty product
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        mu_product, done = 1.0, 0
    beta1, beta2 = group["betas"]
    new_param, m, v, new_mu_product, new_step = nadam_step(
        param, grad, exp_avg, exp_avg_sq, mu_product, done, lr=scalar(group["lr"]), beta1=scalar(beta1),
        beta2=scalar(beta2), eps=group["eps"], weight_decay=group.get("weight_decay", 0),
        momentum_decay=group.get("momentum_decay", 4e-3),
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
        maximize=group.get("maximize", False), capturable=bool(group.get("capturable", False)))
    return Replayed(new_param, {"step": torch.tensor(float(new_step), dtype=torch.float64),
                                "mu_product": torch.tensor(new_mu_product, dtype=torch.float64),
                                "exp_avg": m, "exp_avg_sq": v})
