"""Replay of torch.optim.Adafactor (torch/optim/_adafactor.py, _single_tensor_adafactor / _multi_tensor_adafactor).

The for-loop and foreach implementations compute the same math (only the order of a few float32 roundings differs:
torch.norm(...).square_() against _foreach_mul_, add_(alpha=) against _foreach_mul_ then _foreach_add_), so one rule
covers both at the default tolerance (measured, torch 2.13 CPU, every case in
tests/harness/cases/adafactor_muon_sparseadam.py run for 40 steps: worst 0.24x the tolerance on the parameter, 0.02x
on the state, for either implementation).

eps1 = None (the default, ``eps=(None, 1e-3)``) means ``torch.finfo(param.dtype).eps`` in torch. Rules only see
float64 copies of the record, so the parameter's dtype is inferred: float64 when the recorded values are not all
representable in float32, else float32. A bfloat16 or float16 parameter with eps1 = None is therefore replayed with
float32's eps1 (an engine change passing the recorded dtype to rules would remove this guess). torch also keeps the
eps1 it derived from a group's first parameter for the group's other parameters; a group mixing dtypes is
replayed with each parameter's own.
"""
from __future__ import annotations

import torch

from ..registry import Replayed, kept_when, register


def adafactor_step(param, grad, row_var, col_var, variance, step, *, lr, beta2_decay, eps1, eps2, d, weight_decay,
                   maximize):
    """One Adafactor step; step counts the steps done before this one. row_var/col_var (params with ndim > 1) or
    variance (ndim <= 1) hold the second-moment state. Returns (param, row_var, col_var, variance)."""
    grad = -grad if maximize else grad
    step = step + 1
    one_minus_beta2 = step**beta2_decay
    rho = min(lr, 1 / step**0.5)
    # alpha uses the RMS of the parameter before weight decay
    alpha = max(eps2, float(param.norm(2)) / param.numel() ** 0.5) * rho
    if weight_decay != 0:
        param = param * (1 - lr * weight_decay)
    if grad.dim() > 1:
        # factored second moment over the last two dimensions
        row_var = torch.lerp(row_var, (grad * grad).mean(dim=-1, keepdim=True), one_minus_beta2)
        col_var = torch.lerp(col_var, (grad * grad).mean(dim=-2, keepdim=True), one_minus_beta2)
        var_estimate = (row_var @ col_var) / row_var.mean(dim=-2, keepdim=True).clamp(min=eps1)
    else:
        variance = torch.lerp(variance, grad * grad, one_minus_beta2)
        var_estimate = variance
    update = var_estimate.clamp(min=eps1 * eps1).rsqrt() * grad
    denom = max(1.0, float(update.norm(2)) / (update.numel() ** 0.5 * d))
    return param - (alpha / denom) * update, row_var, col_var, variance


def _fits_float32(*tensors) -> bool:
    return all(bool((t.float().double() == t).all()) for t in tensors if t.is_floating_point())


def _factored(param, group) -> bool:
    return param.dim() > 1


# torch initialises the moments to zero on the first step: a factored row and column variance for params with
# ndim > 1, a full variance otherwise
ADAFACTOR_STATE = {
    "row_var": kept_when(_factored, lambda param, group: param.new_zeros(param.shape[:-1] + (1,))),
    "col_var": kept_when(_factored, lambda param, group: param.new_zeros(param.shape[:-2] + (1,) + param.shape[-1:])),
    "variance": kept_when(lambda param, group: not _factored(param, group)),
}


# By name: torch.optim.Adafactor is absent from older torch, and `import upd` must work there.
@register("torch.optim.Adafactor", state=ADAFACTOR_STATE, counts_steps=True, needs_whole_tensor=True)
def adafactor(param, grad, state, group, step):
    eps1, eps2 = group["eps"]
    if eps1 is None:
        # torch: torch.finfo(param.dtype).eps (see the module docstring)
        dtype = torch.float32 if _fits_float32(param, grad, *state.values()) else torch.float64
        eps1 = torch.finfo(dtype).eps
    new_param, row_var, col_var, variance = adafactor_step(
        param, grad, state.get("row_var"), state.get("col_var"), state.get("variance"), step, lr=group["lr"],
        beta2_decay=group["beta2_decay"], eps1=float(eps1), eps2=float(eps2), d=group["d"],
        weight_decay=group.get("weight_decay", 0), maximize=group.get("maximize", False))
    return Replayed(new_param, {"row_var": row_var, "col_var": col_var, "variance": variance})
