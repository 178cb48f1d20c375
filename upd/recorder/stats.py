"""Per-step summary statistics, computed where the tensors live, with one device-to-host copy per step.

Every function here only launches device work; nothing calls .item()/.cpu() except ``to_host``, which the recorder
calls once per recorded step on the stacked result of all parameters. A step whose tensors hold NaN/Inf pays one
more copy, to count them exactly (see ``count_nonfinite``).
"""
from __future__ import annotations

import math

import torch

# Statistics of one tensor, in this order (columns "<kind>_<stat>" in the run file).
STATS = ("mean", "std", "norm", "absmax", "zero_frac", "nonfinite")
RATIO_COLUMNS = ("update_to_data", "grad_to_data")
NONFINITE = STATS.index("nonfinite")

# Below this size the exact two-pass std is cheap; above it the one-pass form (sum and sum of squares) saves two
# passes over memory. One-pass loses precision only when |mean| >> std, which large weight matrices, gradients,
# updates and moments are not (norm-layer scales near 1 are small tensors, so they get the two-pass form).
TWO_PASS_LIMIT = 1 << 16


def _prepared(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        t = t.float()
    return t.reshape(-1)


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """(6,) float32 tensor on t's device: mean, std (unbiased), L2 norm, abs max, fraction of exact zeros, and a
    NaN/Inf *flag* (0, or NaN when the tensor holds any NaN/Inf; ``count_nonfinite`` turns flags into counts).

    Four memory passes for a large tensor: sum, sum of squares, min/max, count of non-zeros. torch.std_mean is a
    slow Welford loop on CPU (30x a sum), and an exact NaN count would be two more passes on every step."""
    flat = _prepared(t)
    n = flat.numel()
    if n == 0:
        return torch.full((len(STATS),), float("nan"), device=t.device)
    total = flat.sum(dtype=torch.float32)
    mean = total / n
    if n <= TWO_PASS_LIMIT:
        sq_norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
        std = torch.linalg.vector_norm(flat - mean, dtype=torch.float32) / math.sqrt(n - 1) if n > 1 else \
            torch.full((), float("nan"), device=t.device)
        norm = sq_norm
    else:
        # vector_norm reduces in cascaded blocks (accurate); a BLAS dot would accumulate float32 sequentially.
        norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
        sum_sq = norm * norm
        std = ((sum_sq - n * mean * mean).clamp_min(0) / (n - 1)).sqrt()
    low, high = torch.aminmax(flat)
    absmax = torch.maximum(high.abs(), low.abs()).float()
    zero_frac = (n - torch.count_nonzero(flat)).float() / n
    # NaN propagates into the sum and Inf into min/max: finite sum, min and max mean no NaN/Inf anywhere.
    flag = (total + low.float() + high.float()) * 0.0
    return torch.stack([mean, std.float(), norm, absmax, zero_frac, flag])


def scalar_stats(values: list[torch.Tensor]) -> torch.Tensor:
    """Statistics of many one-element tensors (Adam's step counters) in a few batched ops: (len, 6)."""
    v = torch.stack([_prepared(x)[0] for x in values]).float()
    nan = torch.full_like(v, float("nan"))
    return torch.stack([v, nan, v.abs(), v.abs(), (v == 0).float(), v * 0.0], dim=1)


def to_host(parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-tensor statistics and bring them to the host: the one synchronisation of a recorded step."""
    if not parts:
        return torch.empty(0, len(STATS))
    parts = [p.reshape(-1, len(STATS)) for p in parts]
    devices = {p.device for p in parts}
    if len(devices) > 1:  # a model split over devices: gather on one first, still one copy to host
        target = parts[0].device
        parts = [p.to(target, non_blocking=True) for p in parts]
    return torch.cat(parts).cpu()


def count_nonfinite(host: torch.Tensor, tensors: list) -> None:
    """Replace NaN flags in the host table by exact NaN/Inf counts, reading only the flagged tensors again.

    Rows whose tensor is no longer available (None) keep NaN: "some, count unknown"."""
    flagged = [i for i in range(host.shape[0]) if not math.isfinite(float(host[i, NONFINITE]))]
    if not flagged:
        return
    counts = [torch.count_nonzero(~torch.isfinite(_prepared(tensors[i]))).float() if tensors[i] is not None
              else None for i in flagged]
    present = [c for c in counts if c is not None]
    values = iter(torch.stack(present).cpu().tolist()) if present else iter(())
    for i, c in zip(flagged, counts):
        host[i, NONFINITE] = next(values) if c is not None else float("nan")


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
