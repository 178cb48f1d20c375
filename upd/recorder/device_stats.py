"""Per-step summary statistics, computed where the tensors live, with one device-to-host copy per step.

Every function here only launches device work; nothing calls .item()/.cpu() except ``to_host``, which
``StepStatistics.read`` calls once per recorded step on the stacked result of all parameters. A step whose tensors
hold NaN/Inf pays one more copy, to count them exactly (see ``count_nonfinite``).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..ratios import GRAD_TO_DATA, UPDATE_TO_DATA, grad_to_data, update_to_data

# Statistics of one tensor, in this order (columns "<kind>_<stat>" in the run file).
STATS = ("mean", "std", "norm", "absmax", "zero_frac", "nonfinite")
NONFINITE = STATS.index("nonfinite")
SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)

# Below this size the exact two-pass std is cheap; above it the one-pass form (sum and sum of squares) saves two
# passes over memory. One-pass loses precision only when |mean| >> std, which large weight matrices, gradients,
# updates and moments are not (norm-layer scales near 1 are small tensors, so they get the two-pass form).
TWO_PASS_LIMIT = 4096


def _prepared(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.layout in SPARSE_LAYOUTS:  # sparse gradients (nn.Embedding(sparse=True)) and parameters: the statistics
        t = t.to_dense()            # are those of the dense tensor, implicit zeros included, as the run stores it
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        t = t.float()
    return t.reshape(-1)


def element_count(t: torch.Tensor) -> int:
    """How many numbers a tensor's statistics are taken over (a complex element is two, see _prepared)."""
    return t.numel() * (2 if t.is_complex() else 1)


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


def batched_stats(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(len, 6) statistics of many small tensors on one device in a dozen ops, whatever their number.

    Per-tensor reductions cost ~10 kernel launches each: on a transformer's biases, norm scales and step counters
    that dispatch overhead, not memory, dominated. One concatenation and segment reductions replace it."""
    flats = [_prepared(t) for t in tensors]
    device = flats[0].device
    counts = [f.numel() for f in flats]
    total = sum(counts)
    flat = torch.cat(flats).float()
    k = len(flats)
    lengths = torch.tensor(counts, device=device, dtype=torch.float32)
    seg = torch.repeat_interleave(torch.arange(k, device=device), torch.tensor(counts, device=device),
                                  output_size=total)  # output_size: no device-to-host sync on CUDA
    zeros = torch.zeros(k, device=device)
    sums = zeros.index_add(0, seg, flat)
    mean = sums / lengths
    centered = flat - mean[seg]
    var = zeros.index_add(0, seg, centered * centered) / (lengths - 1)
    std = torch.where(lengths > 1, var.sqrt(), torch.full_like(var, float("nan")))
    norm = zeros.index_add(0, seg, flat * flat).sqrt()
    absmax = zeros.scatter_reduce(0, seg, flat.abs(), reduce="amax", include_self=False)
    zero_frac = zeros.index_add(0, seg, (flat == 0).float()) / lengths
    flag = (sums + absmax) * 0.0  # NaN exactly when a segment holds NaN/Inf
    return torch.stack([mean, std, norm, absmax, zero_frac, flag], dim=1)


def _large_stats(flats: list[torch.Tensor], count_zeros: list[bool]) -> torch.Tensor:
    """(len, 6) for large tensors: four memory passes each (norm, sum, min/max, non-zeros), norms in one foreach
    call, std in the one-pass form (see TWO_PASS_LIMIT)."""
    norms = torch.stack(torch._foreach_norm(flats)).float()
    sums = torch.stack([f.sum(dtype=torch.float32) for f in flats])
    lows, highs = zip(*(torch.aminmax(f) for f in flats))
    lows, highs = torch.stack(lows).float(), torch.stack(highs).float()
    n = torch.tensor([f.numel() for f in flats], device=norms.device, dtype=torch.float32)
    # count_nonzero is the slowest pass here (4x a sum on CPU): only for the kinds asked for, NaN elsewhere.
    nonzero = torch.stack([torch.count_nonzero(f).float() if c else torch.full((), float("nan"), device=f.device)
                           for f, c in zip(flats, count_zeros)])
    mean = sums / n
    std = ((norms * norms - n * mean * mean).clamp_min(0) / (n - 1)).sqrt()
    absmax = torch.maximum(lows.abs(), highs.abs())
    flag = (sums + lows + highs) * 0.0
    return torch.stack([mean, std, norms, absmax, (n - nonzero) / n, flag], dim=1)


def stats_rows(tensors: list[torch.Tensor], count_zeros=True) -> torch.Tensor:
    """(len, 6) statistics of a list of tensors, in input order: small ones batched into one concatenation, large
    ones with a few per-tensor reductions. Nothing here waits for the device. count_zeros (a bool, or one per
    tensor) says whose zero fraction to count; the others get NaN."""
    if isinstance(count_zeros, bool):
        count_zeros = [count_zeros] * len(tensors)
    if not tensors:
        return torch.empty(0, len(STATS))
    flats = [_prepared(t) for t in tensors]
    if len({f.device for f in flats}) > 1:  # a model split over devices: one by one, still no sync
        return torch.stack([tensor_stats(t).to(flats[0].device) for t in tensors])
    small = [i for i, f in enumerate(flats) if 0 < f.numel() <= TWO_PASS_LIMIT]
    small_set = set(small)
    large = [i for i, f in enumerate(flats) if i not in small_set and f.numel() > 0]
    empty = [i for i, f in enumerate(flats) if f.numel() == 0]
    blocks, order = [], []
    if large:
        blocks.append(_large_stats([flats[i] for i in large], [count_zeros[i] for i in large]))
        order += large
    if small:
        blocks.append(batched_stats([flats[i] for i in small]))
        order += small
    if empty:
        blocks.append(torch.full((len(empty), len(STATS)), float("nan"), device=flats[0].device))
        order += empty
    rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    if order != list(range(len(order))):
        inverse = [0] * len(order)
        for position, i in enumerate(order):
            inverse[i] = position
        rows = rows[torch.tensor(inverse, device=rows.device)]
    if not all(count_zeros):  # the batched small tensors were counted anyway: report only what was asked
        keep = torch.tensor(count_zeros, device=rows.device)
        zero_col = STATS.index("zero_frac")
        rows[:, zero_col] = torch.where(keep, rows[:, zero_col], torch.full_like(rows[:, zero_col], float("nan")))
    return rows


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


class StepStatistics:
    """The statistics of one recorded step: launched on the device as the tensors become available (gradients and
    state before the step, when the step would change them; the rest after it), then read with one copy.

    Keys are (parameter name, kind), kind one of "param", "grad", "update", "state.<key>"; ``read`` returns
    {name: {"<kind>_<stat>": value, ..., "update_to_data": ..., "grad_to_data": ...}} in launch order."""

    def __init__(self, zero_counts: Sequence[str]):
        self._zero_counts = tuple(zero_counts)  # kinds whose fraction of exact zeros is counted (see stats_rows)
        self._keys: list[tuple[str, str]] = []
        self._rows: list[torch.Tensor] = []
        self._recount: list = []  # per launch: its tensors, or a function giving them at read time

    def launch(self, keys: list[tuple[str, str]], tensors: list[torch.Tensor],
               recount: Callable[[], list] | None = None) -> None:
        """Launch the statistics of `tensors`. `recount` gives, at read time, the tensors in which a flagged NaN/Inf
        is counted (None for one no longer available); by default these same tensors, held until then."""
        self._rows.append(stats_rows(tensors, [kind.split(".")[0] in self._zero_counts for _, kind in keys]))
        self._keys += keys
        self._recount.append(tensors if recount is None else recount)

    def read(self) -> dict[str, dict[str, float]]:
        """Everything launched, on the host, with update:data and grad:data per parameter."""
        host = to_host(self._rows)
        sources = []
        for recount in self._recount:
            sources += recount() if callable(recount) else recount
        count_nonfinite(host, sources)
        out: dict[str, dict[str, float]] = {}
        for (name, kind), row in zip(self._keys, host.tolist()):
            values = out.setdefault(name, {})
            for stat, v in zip(STATS, row):
                values[f"{kind}_{stat}"] = v
        for values in out.values():
            p_std = values.get("param_std", float("nan"))
            values[UPDATE_TO_DATA] = float(update_to_data(values.get("update_std", float("nan")), p_std))
            values[GRAD_TO_DATA] = float(grad_to_data(values.get("grad_std", float("nan")), p_std))
        return out
