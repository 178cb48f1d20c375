"""Replay of torch.optim.Rprop (torch/optim/rprop.py: _single_tensor_rprop, _multi_tensor_rprop).

    g = -grad if maximize else grad
    factor = etaplus where g * prev > 0, etaminus where < 0, 1 where == 0
    step_size = clamp(step_size * factor, step_size_min, step_size_max)
    g = 0 where factor == etaminus                    (no move after a sign change, and forget that gradient)
    param -= sign(g) * step_size;  prev = g

lr only sets the initial step_size (state created on the first step), so it matters at step 0 only.
The for-loop, foreach and capturable (torch.where instead of masked assignment) paths compute the same thing;
differentiable only clones prev. No flag changes the replay.
"""
from __future__ import annotations

import torch

from ..registry import Replayed, register, zeros

_NARROW = (torch.float16, torch.bfloat16, torch.float32)


def _working_dtype(*tensors) -> torch.dtype:
    """The narrowest float dtype holding every recorded value exactly: torch multiplies grad * prev in the
    parameter's dtype, and a product that underflows there to 0 takes the factor-1 branch, not etaplus/etaminus.
    (Recorded values are exact copies of the parameter-dtype values unless stored in a reduced dtype.)"""
    for dtype in _NARROW:
        if all(bool((t.to(dtype).double() == t).all()) for t in tensors):
            return dtype
    return torch.float64


def rprop_step(param, grad, prev, step_size, *, etaminus, etaplus, step_size_min, step_size_max, maximize):
    """One Rprop step. Returns (param, prev, step_size)."""
    grad = -grad if maximize else grad
    dtype = _working_dtype(param, grad, prev)
    sign = (grad.to(dtype) * prev.to(dtype)).sign().double()
    factor = torch.where(sign > 0, etaplus, torch.where(sign < 0, etaminus, 1.0)).to(grad.dtype)
    factor = torch.where(sign.isnan(), sign, factor)  # torch leaves a NaN sign in place
    step_size = (step_size * factor).clamp(step_size_min, step_size_max)
    grad = torch.where(sign < 0, torch.zeros_like(grad), grad)
    return param - grad.sign() * step_size, grad, step_size


# first step: prev = 0, every step size = the group's lr (the only use of lr)
RPROP_STATE = {"prev": zeros, "step_size": lambda param, group: torch.full_like(param, group["lr"])}


@register(torch.optim.Rprop, state=RPROP_STATE, counts_steps=True, elementwise=True)
def rprop(param, grad, state, group, step):
    etaminus, etaplus = group["etas"]
    step_size_min, step_size_max = group["step_sizes"]
    new_param, prev, step_size = rprop_step(
        param, grad, state["prev"], state["step_size"], etaminus=etaminus, etaplus=etaplus,
        step_size_min=step_size_min, step_size_max=step_size_max, maximize=group.get("maximize", False))
    return Replayed(new_param, {"prev": prev, "step_size": step_size})
