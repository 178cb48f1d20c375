"""What update:data and grad:data mean, defined once for the recorder's device statistics and the analyzer alike.

Karpathy's rule of thumb (makemore part 3) watches, per weight and step,

    update_to_data = log10(std(param_after - param) / std(param))
    grad_to_data   = log10(std(grad) / std(param))

with std the unbiased standard deviation (``torch.Tensor.std()``) of the parameter *before* the step. Healthy
training keeps update_to_data near -3: each step changes a weight by about a thousandth of its spread.

Edge cases follow IEEE division, the same on floats, numpy arrays and torch tensors: a zero numerator gives -inf
(the weight did not move), a zero denominator +inf, 0/0 and NaN inputs NaN.
"""
from __future__ import annotations

import numpy as np

UPDATE_TO_DATA = "update_to_data"
GRAD_TO_DATA = "grad_to_data"
RATIO_NAMES = (UPDATE_TO_DATA, GRAD_TO_DATA)


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
