"""Replay of torch.optim.SparseAdam (torch/optim/sparse_adam.py, torch/optim/_functional.py sparse_adam).

SparseAdam updates exp_avg, exp_avg_sq and the parameter only where the (coalesced) sparse gradient has entries.
The recorder stores sparse gradients densified, which loses the set of entries the sparse gradient held. The rule
reconstructs it from the dense values, slice by slice along the gradient's sparse dimensions
(``nn.Embedding(sparse=True)``: one row per looked-up index): a slice is taken as present when any of its values is
non-zero. LIMITATION: a slice whose gradient is exactly zero everywhere but that the sparse gradient did hold is
treated as absent, although torch decays its moments and moves the parameter there; such a step replays as a
mismatch in that slice. The number of sparse dimensions is not recorded either: it is taken as 1 (row slices),
which is what nn.Embedding and nn.EmbeddingBag produce.
"""
from __future__ import annotations

import torch

from ..registry import Replayed, register, zeros


def present_rows(grad: torch.Tensor) -> torch.Tensor:
    """Boolean mask over grad's first dimension: the rows the densified sparse gradient has a non-zero value in."""
    if grad.dim() == 0:
        return (grad != 0).reshape(1)
    return (grad != 0).reshape(grad.shape[0], -1).any(dim=1)


def sparse_adam_step(param, grad, exp_avg, exp_avg_sq, step, rows, *, lr, beta1, beta2, eps, maximize):
    """One SparseAdam step on the rows where ``rows`` (a mask over dim 0) is True; step counts the steps done before
    this one (torch counts a step even when the gradient is empty). Returns (param, exp_avg, exp_avg_sq)."""
    step = step + 1
    if not bool(rows.any()):  # torch skips the update for an empty gradient
        return param, exp_avg, exp_avg_sq
    shape = param.shape
    if param.dim() == 0:
        param, grad, exp_avg, exp_avg_sq = (t.reshape(1) for t in (param, grad, exp_avg, exp_avg_sq))
    grad = -grad if maximize else grad
    g = grad[rows]
    m_old, v_old = exp_avg[rows], exp_avg_sq[rows]
    m = m_old + (g - m_old) * (1 - beta1)
    v = v_old + (g * g - v_old) * (1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr * bias_correction2**0.5 / bias_correction1
    exp_avg, exp_avg_sq, param = exp_avg.clone(), exp_avg_sq.clone(), param.clone()
    exp_avg[rows], exp_avg_sq[rows] = m, v
    param[rows] = param[rows] - step_size * (m / (v.sqrt() + eps))
    return param.reshape(shape), exp_avg.reshape(shape), exp_avg_sq.reshape(shape)


# torch initialises the moments to zero on the first step
@register(torch.optim.SparseAdam, state={"exp_avg": zeros, "exp_avg_sq": zeros}, counts_steps=True,
          needs_whole_rows=True)
def sparse_adam(param, grad, state, group, step):
    beta1, beta2 = group["betas"]
    new_param, exp_avg, exp_avg_sq = sparse_adam_step(
        param, grad, state["exp_avg"], state["exp_avg_sq"], step, present_rows(grad), lr=group["lr"], beta1=beta1,
        beta2=beta2, eps=group["eps"], maximize=group.get("maximize", False))
    return Replayed(new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})
