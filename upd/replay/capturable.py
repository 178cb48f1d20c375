"""Step-dependent scalars computed the way torch's capturable code paths compute them.

With ``capturable=True`` (CUDA graphs; torch refuses it on CPU) torch keeps the step counter as a float32 tensor and
computes the scalars that depend on it (bias corrections ``beta**t``, RAdam's rho_t, NAdam's momentum schedule) as
float32 tensor arithmetic on that counter, so a Python-float beta is rounded to float32 where it meets the counter.
The other paths compute them in Python double. The difference moves ``1 - beta2**t`` by ~6e-8 * t / (1 - beta2**t)
relative, which is more than float32 rounding of the result, so the Adamax, NAdam and RAdam rules compute these
scalars the same way as the path the recorded group selected (assuming torch's default float32 step counter);
each rule's docstring gives the measured effect.
"""
from __future__ import annotations

import torch


def step_scalar(step: int, float32: bool):
    """The step counter as torch's capturable paths hold it (a float32 tensor), else the plain int."""
    return torch.tensor(float(step), dtype=torch.float32) if float32 else step


def beta_power(beta: float, step: int, *, float32: bool = False) -> float:
    """beta ** step in Python double, or (capturable paths) as torch's float32 tensor power of the step counter."""
    return float(beta ** step_scalar(step, float32))
