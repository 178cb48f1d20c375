"""Replay of torch.optim.Muon (torch/optim/_muon.py, _single_tensor_muon; Muon has no foreach or fused path).

Muon orthogonalises the (Nesterov) momentum with a Newton-Schulz iteration that torch runs in bfloat16. That
iteration cannot be replayed in float64: it amplifies rounding so much that a float64 replay differs from the
recorded update by 1% to 100% of its size. The rule therefore runs torch's own bfloat16 operations (cast, norm,
division, addmm) on the same input: the momentum is computed in the parameter's dtype exactly as torch does, so the
bfloat16 input rounds element for element like torch's. Only the lr adjustment, the weight decay and the final
update are computed in float64.

The bfloat16 iteration is reproduced bit for bit only where the verifying machine's bfloat16 matmul kernel rounds
like the recording machine's. A single bfloat16 rounding difference inside the iteration changes the update by
about 1.5% of its size (median; up to 8%), measured by moving one input element by one bfloat16 unit. So a record
made on another backend (CUDA, or a CPU whose oneDNN bfloat16 kernels differ; oneDNN against the fallback kernel
on a 128x256 weight: 1.2%) will mismatch at any tolerance that still detects a 1% error in the update; verify such
records on the same backend, or pass a coarse ``rtol`` (e.g. 0.1) to check only the gross update.

The parameter's dtype is inferred from the record (float64 when its values are not all representable in float32,
else float32): a bfloat16 or float16 parameter is replayed as float32, which rounds the momentum differently.
"""
from __future__ import annotations

import math

import torch

from ..registry import DEFAULT_RTOL, NotReplayable, Replayed, register, zeros

# Tolerance: the default. Measured on CPU records (torch 2.13; 18 configurations of ns_steps, ns_coefficients,
# nesterov, momentum, eps, adjust_lr_fn, weight_decay, tensor lr on the mlp/conv/attention models, 40 steps each):
# the replayed momentum buffer equals the recorded one exactly, the orthogonalised update is reproduced bit for
# bit, and the only error is the float32 rounding of the final parameter (worst 5.6e-6 of the update, 0.17x the
# default tolerance). No looser rtol is justified: see the module docstring for records from other kernels.
MUON_RTOL = DEFAULT_RTOL


def zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps):
    """torch's _zeropower_via_newtonschulz: quintic Newton-Schulz orthogonalisation of a 2-D matrix, in bfloat16."""
    a, b, c = ns_coefficients
    ortho = update.bfloat16()
    transposed = update.size(0) > update.size(1)
    if transposed:
        ortho = ortho.T
    ortho = ortho / ortho.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if transposed else ortho


def adjusted_lr(lr, adjust_lr_fn, shape):
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    else:
        ratio = 1.0
    return lr * ratio


def muon_step(param, grad, momentum_buffer, *, lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps,
              adjust_lr_fn, input_dtype=torch.float32):
    """One Muon step. Returns (new_param, new_momentum_buffer).

    input_dtype: the dtype torch computed the momentum in (the parameter's), which is then rounded to bfloat16.
    """
    # The momentum is computed in the parameter's dtype, as torch does: the bfloat16 rounding of the
    # Newton-Schulz input then matches torch's element for element.
    grad_t = grad.to(input_dtype)
    buf = torch.lerp(momentum_buffer.to(input_dtype), grad_t, 1 - momentum)
    update = torch.lerp(grad_t, buf, momentum) if nesterov else buf
    ortho = zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps).double()
    param = param * (1 - lr * weight_decay)
    return param - adjusted_lr(lr, adjust_lr_fn, param.shape) * ortho, buf.double()


def _fits_float32(*tensors) -> bool:
    return all(bool((t.float().double() == t).all()) for t in tensors)


# By name: torch.optim.Muon is absent from older torch, and `import upd` must work there.
@register("torch.optim.Muon", rtol=MUON_RTOL, state={"momentum_buffer": zeros}, needs_whole_tensor=True)
def muon(param, grad, state, group, step):
    if param.dim() != 2:
        raise NotReplayable(f"Muon updates 2-D parameters only; this one has shape {tuple(param.shape)}")
    buf = state["momentum_buffer"]
    dtype = torch.float32 if _fits_float32(param, grad, buf) else torch.float64
    new_param, buf = muon_step(param, grad, buf, lr=group["lr"], weight_decay=group["weight_decay"],
                               momentum=group["momentum"], nesterov=group["nesterov"],
                               ns_coefficients=tuple(group["ns_coefficients"]), ns_steps=int(group["ns_steps"]),
                               eps=group["eps"], adjust_lr_fn=group.get("adjust_lr_fn"), input_dtype=dtype)
    return Replayed(new_param, {"momentum_buffer": buf})
