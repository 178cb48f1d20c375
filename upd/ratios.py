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
