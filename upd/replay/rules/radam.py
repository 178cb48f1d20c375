"""Replay of torch.optim.RAdam (torch/optim/radam.py, _single_tensor_radam and _multi_tensor_radam).

RAdam rectifies Adam's adaptive step while the variance of the adaptive lr is intractable: with
rho_inf = 2 / (1 - beta2) - 1 and rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t), a step with rho_t > 5 is
Adam-like, scaled by the rectification term r_t = sqrt((rho_t-4)(rho_t-2) rho_inf / ((rho_inf-4)(rho_inf-2) rho_t));
otherwise it is SGD with momentum on the bias-corrected first moment. With beta2 = 0.999 the first 5 steps are SGD-like.

What the recorded group's flags select (torch has no fused RAdam):
- the scalars: the capturable paths compute rho_t and the bias corrections as float32 tensor arithmetic on the
  float32 step counter (beta1**t and beta2**t with the betas rounded to float32, which moves 1 - beta2**t by
  ~6e-8 * t / (1 - beta2**t) relative), the others in Python double; the replay computes them the same way (assuming
  torch's default float32 step counter), so that a step near rho_t = 5 takes the same branch as torch did (with
  beta2 = 0.9985, rho_5 is 4.994 in double but 5.0026 in float32: capturable rectifies step 5, the others do not;
  replaying that step with the double rho_t misses by ~5e4x the tolerance);
- the update: the foreach path (foreach=True, not differentiable) builds one per-element multiplier
  1 / ((sqrt(v) + eps) / (-lr r_t sqrt(bc2) / bc1)) - lr (1 - [rectified]) / bc1, the for-loop path branches. The
  two agree except where sqrt(v) + eps == 0 (eps=0 and an element that never had a gradient): there the foreach
  SGD-like step divides 0 by -0.0 and writes NaN, the for-loop leaves the element alone. foreach=None is replayed as
  the for-loop path (what torch picks for CPU tensors; the record does not say which device ran the step).
"""
from __future__ import annotations

import torch

from ..capturable import beta_power, step_scalar
from ..registry import Replayed, register, zeros


def rho(step, beta2, *, float32=False):
    """(rho_inf, rho_t) for the step-th step (1-based), as torch computes them: in Python double, or (capturable)
    as float32 tensor arithmetic on the float32 step counter."""
    rho_inf = 2 / (1 - beta2) - 1
    t = step_scalar(step, float32)
    return rho_inf, float(rho_inf - 2 * t * (beta2**t) / (1 - beta2**t))


def rectification(rho_t, rho_inf):
    return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5


def radam_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
               decoupled_weight_decay, maximize, foreach=False, capturable=False):
    """One RAdam step; step counts the steps done before this one. Returns (param, exp_avg, exp_avg_sq)."""
    grad = -grad if maximize else grad
    step = step + 1
    rho_inf, rho_t = rho(step, beta2, float32=capturable)
    if weight_decay != 0:
        if decoupled_weight_decay:
            param = param * (1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
    exp_avg = exp_avg + (grad - exp_avg) * (1 - beta1)  # torch uses lerp_
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta_power(beta1, step, float32=capturable)
    bias_correction2 = 1 - beta_power(beta2, step, float32=capturable)
    rectified = rho_t > 5.0
    if foreach:
        rect = rectification(rho_t, rho_inf) if rectified else 0.0
        unrect_step_size = -(lr * (0.0 if rect > 0 else 1.0) / bias_correction1)
        rect_step_size = -(bias_correction2**0.5 * (lr * rect / bias_correction1))  # -0.0 when not rectified
        buffer = ((exp_avg_sq.sqrt() + eps) / rect_step_size).reciprocal() + unrect_step_size
        param = param + exp_avg * buffer
    elif rectified:
        adaptive_lr = bias_correction2**0.5 / (exp_avg_sq.sqrt() + eps)
        param = param - exp_avg / bias_correction1 * lr * adaptive_lr * rectification(rho_t, rho_inf)
    else:
        param = param - exp_avg / bias_correction1 * lr
    return param, exp_avg, exp_avg_sq


# torch initialises both moments to zero on the first step
@register(torch.optim.RAdam, state={"exp_avg": zeros, "exp_avg_sq": zeros}, counts_steps=True, elementwise=True)
def radam(param, grad, state, group, step):
    beta1, beta2 = group["betas"]
    differentiable = bool(group.get("differentiable", False))
    new_param, exp_avg, exp_avg_sq = radam_step(
        param, grad, state["exp_avg"], state["exp_avg_sq"], step, lr=group["lr"], beta1=beta1, beta2=beta2,
        eps=group["eps"], weight_decay=group.get("weight_decay", 0),
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
        maximize=group.get("maximize", False),
        # differentiable=True runs the for-loop (torch's foreach path raises for it)
        foreach=group.get("foreach") is True and not differentiable,
        capturable=bool(group.get("capturable", False)))
    return Replayed(new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})
