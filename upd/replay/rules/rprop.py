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

from ..registry import Replayed, register, require, scalar

_NARROW = (torch.float16, torch.bfloat16, torch.float32)


def _working_dtype(*tensors) -> torch.dtype:
    """The narrowest float dtype holding every recorded value exactly: torch multiplies grad * prev in the
    parameter's dtype, and a product that underflows there to 0 takes the factor-1 branch, not etaplus/etaminus.
    (Recorded values are exact copies of the parameter-dtype values unless stored in a reduced dtype.)"""
    for dtype in _NARROW:
        if all(bool((t.to(dtype).double() == t).all()) for t in tensors):
            return dtype
    return torch.float64


def rprop_step(param, grad, prev, step_size, step, *, etaminus, etaplus, step_size_min, step_size_max, maximize):
    """One Rprop step; step counts the steps done before this one. Returns (param, prev, step_size, new step)."""
    grad = -grad if maximize else grad
    step = step + 1
    dtype = _working_dtype(param, grad, prev)
    sign = (grad.to(dtype) * prev.to(dtype)).sign().double()
    factor = torch.where(sign > 0, etaplus, torch.where(sign < 0, etaminus, 1.0)).to(grad.dtype)
    factor = torch.where(sign.isnan(), sign, factor)  # torch leaves a NaN sign in place
    step_size = (step_size * factor).clamp(step_size_min, step_size_max)
    grad = torch.where(sign < 0, torch.zeros_like(grad), grad)
    return param - grad.sign() * step_size, grad, step_size, step


@register(torch.optim.Rprop)
def rprop(param, grad, state, group, step):
    if state:
        require(state, ("prev", "step_size", "step"))
        prev, step_size = state["prev"], state["step_size"]
        done = int(round(float(state["step"])))
    else:  # first step: prev = 0, every step size = the group's lr (the only use of lr)
        prev = torch.zeros_like(param)
        step_size = torch.full_like(param, scalar(group["lr"]))
        done = 0
    etaminus, etaplus = (scalar(e) for e in group["etas"])
    step_size_min, step_size_max = (scalar(s) for s in group["step_sizes"])
    new_param, new_prev, new_step_size, new_step = rprop_step(
        param, grad, prev, step_size, done, etaminus=etaminus, etaplus=etaplus, step_size_min=step_size_min,
        step_size_max=step_size_max, maximize=group.get("maximize", False))
    return Replayed(new_param, {"step": torch.tensor(float(new_step), dtype=torch.float64), "prev": new_prev,
                                "step_size": new_step_size})
