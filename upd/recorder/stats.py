"""Per-step summary statistics, computed where the tensors live, with one device-to-host copy per step.

Every function here only launches device work; nothing calls .item()/.cpu() except ``to_host``, which the recorder
calls once per recorded step on the stacked result of all parameters.
"""
from __future__ import annotations

import math

import torch

# Statistics of one tensor, in this order (columns "<kind>_<stat>" in the run file).
STATS = ("mean", "std", "norm", "absmax", "zero_frac", "nonfinite")
RATIO_COLUMNS = ("update_to_data", "grad_to_data")


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """(6,) float32 tensor on t's device: mean, std (unbiased), L2 norm, abs max, fraction of exact zeros, NaN/Inf count.

    Two-pass mean/std: torch.std_mean is a slow Welford loop on CPU (30x a sum here), and the one-pass formula from
    the norm loses the std of weights whose mean dwarfs their spread (norm-layer scales near 1)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        t = t.float()
    flat = t.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.full((len(STATS),), float("nan"), device=t.device)
    mean = flat.sum(dtype=torch.float32) / n
    std = (torch.linalg.vector_norm(flat - mean, dtype=torch.float32) / math.sqrt(n - 1)) if n > 1 else \
        torch.tensor(float("nan"), device=t.device)
    norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
    low, high = torch.aminmax(flat)
    absmax = torch.maximum(high.abs(), low.abs()).float()
    zero_frac = (n - torch.count_nonzero(flat)).float() / n
    # x - x is 0 for finite x and NaN for NaN/Inf, and count_nonzero counts NaN: one cheap pass.
    nonfinite = torch.count_nonzero(flat - flat).float()
    return torch.stack([mean, std.float(), norm, absmax, zero_frac, nonfinite])


def to_host(parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-tensor statistics and bring them to the host: the one synchronisation of a recorded step."""
    if not parts:
        return torch.empty(0, len(STATS))
    devices = {p.device for p in parts}
    if len(devices) > 1:  # a model split over devices: gather on one first, still one copy to host per device
        target = parts[0].device
        parts = [p.to(target, non_blocking=True) for p in parts]
    return torch.stack(parts).cpu()


def columns_for(state_keys: list[str]) -> list[str]:
    kinds = ["param", "grad", "update"] + [f"state.{k}" for k in state_keys]
    return [f"{kind}_{stat}" for kind in kinds for stat in STATS] + list(RATIO_COLUMNS)


def log10_ratio(numerator: float, denominator: float) -> float:
    """log10(numerator/denominator) with the same conventions as the tensor path: -inf for 0/x, inf for x/0."""
    if math.isnan(numerator) or math.isnan(denominator):
        return math.nan
    if denominator == 0:
        return math.nan if numerator == 0 else math.inf
    if numerator == 0:
        return -math.inf
    return math.log10(numerator / denominator)
