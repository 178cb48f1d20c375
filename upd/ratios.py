"""What update:data and grad:data mean, defined once for the recorder's device statistics and the analyzer alike.

Karpathy's rule of thumb (makemore part 3) watches, per weight and step,

    update_to_data = log10(std(param_after - param) / std(param))
    grad_to_data   = log10(std(grad) / std(param))

with std the unbiased standard deviation (``torch.Tensor.std()``) of the parameter *before* the step. Healthy
training keeps update_to_data near -3: each step changes a weight by about a thousandth of its spread.

Edge cases follow IEEE division, the same on floats, numpy arrays and torch tensors: a zero numerator gives -inf
(the weight did not move), a zero denominator +inf, 0/0 and NaN inputs NaN.

Complex parameters: the statistics (std, norm, mean) of a complex tensor are those of its real and imaginary parts
taken as 2n real numbers (``torch.view_as_real``, see ``real_numbers``). The norm is then the complex tensor's own
L2 norm, and the std measures the spread of both parts around their means, so a rotation of the weights in the
complex plane counts like any other change. The recorder's statistics and the analyzer use the same definition.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from .statistics import GRAD_TO_DATA, UPDATE_TO_DATA
from .statistics import RATIOS as RATIO_NAMES
from .torch_threads import one_torch_thread


def real_numbers(t: torch.Tensor) -> torch.Tensor:
    """The numbers a tensor's ratio statistics are taken over: a complex tensor's real and imaginary parts as pairs
    (``torch.view_as_real``: shape (..., 2), no copy), any other tensor as it is."""
    import torch  # here: the ratio names and log10_ratio serve readers that import no torch

    return torch.view_as_real(t) if t.is_complex() else t


def log10_ratio(numerator, denominator):
    """log10(numerator / denominator) elementwise, for floats, numpy arrays or CPU tensors (returns numpy)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log10(np.divide(np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)))


def update_to_data(update_std, param_std):
    """log10(std(update) / std(param before the step))."""
    return log10_ratio(update_std, param_std)


def grad_to_data(grad_std, param_std):
    """log10(std(grad) / std(param before the step))."""
    return log10_ratio(grad_std, param_std)


# The metrics other tools log beside the std ratio (docs/diagnosis.md, "Metrics"), log10 like the two above so
# that all three read on the same scale (healthy near -3).
RMS_UPDATE_TO_DATA = "rms_update_to_data"
SPECTRAL_UPDATE_TO_DATA = "spectral_update_to_data"


def rms_update_to_data(update_norm, param_norm):
    """log10(||update||_F / ||param before the step||_F): the relative Frobenius norm of the update, the "RMS
    ratio" T5X, Composer and Cockpit log (RMS(dW) / RMS(W) over the same n elements is the same quotient). From the
    L2 norms the recorder and the analyzer already compute; unlike the std ratio it counts a shift of the mean."""
    return log10_ratio(update_norm, param_norm)


# Power iterations of spectral_norm: each multiplies by A^T A, so the error in sigma_1 shrinks like
# (sigma_2 / sigma_1)^(2 * iterations); tests/analyzer/test_metrics.py states the tolerance this gives.
POWER_ITERATIONS = 30


def spectral_norms(matrices: torch.Tensor, iterations: int = POWER_ITERATIONS, seed: int = 0) -> np.ndarray:
    """The largest singular value ||A||_2 of each matrix of a batch (B, m, n), by power iteration on A^T A from a
    fixed random start (float64; a few batched matrix-vector products, never a decomposition). Each is a lower bound
    that converges from below; a zero matrix gives 0, a non-finite one NaN. On one torch thread: the products are
    too small for its pool to pay off (upd/torch_threads.py)."""
    with one_torch_thread():
        return _spectral_norms(matrices, iterations, seed)


def _spectral_norms(matrices: torch.Tensor, iterations: int, seed: int) -> np.ndarray:
    import torch  # here, as in real_numbers

    a = matrices.to(torch.complex128 if matrices.is_complex() else torch.float64)
    if a.shape[-1] == 0 or a.shape[-2] == 0:
        return np.zeros(a.shape[0])
    if a.shape[-2] < a.shape[-1]:
        a = a.mH  # iterate in the smaller dimension
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(a.shape[-1], generator=gen, dtype=torch.float64).to(a.dtype).expand(a.shape[0], -1)
    tiny = torch.finfo(torch.float64).tiny
    for _ in range(iterations):
        u = torch.bmm(a, v.unsqueeze(-1)).squeeze(-1)
        u = u / torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(tiny)
        w = torch.bmm(a.mH, u.unsqueeze(-1)).squeeze(-1)
        v = w / torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp_min(tiny)
    sigma = torch.linalg.vector_norm(torch.bmm(a, v.unsqueeze(-1)).squeeze(-1), dim=-1).numpy()
    finite = torch.isfinite(a).flatten(1).all(1).numpy()
    return np.where(finite, sigma, np.nan)


def spectral_norm(matrix: torch.Tensor, iterations: int = POWER_ITERATIONS, seed: int = 0) -> float:
    """spectral_norms of one 2-D tensor."""
    return float(spectral_norms(matrix.unsqueeze(0), iterations, seed)[0])


def spectral_update_to_data(before: torch.Tensor, after: torch.Tensor, iterations: int = POWER_ITERATIONS):
    """log10(||after - before||_2 / ||before||_2) of a weight: the spectral-norm ratio whose scaling the "spectral
    condition for feature learning" (Yang, Simon and Bernstein, arXiv 2310.17813) states. A weight with more than
    two dimensions is the matrix (out, everything else), as a convolution kernel (out, in, kh, kw) maps its
    flattened input patch to its output channels; NaN for a tensor with fewer than two dimensions."""
    return float(spectral_update_to_data_batch(before.unsqueeze(0), after.unsqueeze(0), iterations)[0])


def spectral_update_to_data_batch(before: torch.Tensor, after: torch.Tensor,
                                  iterations: int = POWER_ITERATIONS) -> np.ndarray:
    """spectral_update_to_data of each record of a batch: before/after shaped (B, *weight_shape)."""
    import torch  # here, as in real_numbers

    if before.dim() < 3:
        return np.full(before.shape[0], np.nan)
    wide = torch.complex128 if before.is_complex() else torch.float64
    before, after = before.to(wide), after.to(wide)
    rows = before.shape[1]
    update = (after - before).reshape(before.shape[0], rows, -1)
    return log10_ratio(spectral_norms(update, iterations), spectral_norms(before.reshape(before.shape[0], rows, -1),
                                                                        iterations))
