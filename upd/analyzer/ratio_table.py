"""Update:data and grad:data ratios. Pure functions on tensors, plus the streaming DataFrame builder."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from ..ratios import GRAD_TO_DATA, UPDATE_TO_DATA, grad_to_data, real_numbers, update_to_data
from ..runfile import schema

RATIO_TABLE_COLUMNS = ["optimizer", "param", "record", "step", "lr", "numel", "update_to_data", "grad_to_data",
                 "update_std", "param_std", "grad_std", "update_norm", "grad_norm", "param_norm",
                 "grad_nonfinite", "flag"]


def row_std(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each row of a (rows, ...) tensor, like torch.Tensor.std() on each recorded tensor."""
    flat = real_numbers(x).reshape(x.shape[0], -1).double()
    if flat.shape[1] < 2:
        return torch.full((x.shape[0],), float("nan"), dtype=torch.float64)
    return flat.std(dim=1)


def row_norm(x: torch.Tensor) -> torch.Tensor:
    return real_numbers(x).reshape(x.shape[0], -1).double().norm(dim=1)


def ratio_flags(numel: int, param_std, update_std, grad_nonfinite) -> list[str]:
    """Why a ratio is not a plain finite number, per row ('' when it is)."""
    flags = []
    for p_std, u_std, bad in zip(param_std, update_std, grad_nonfinite):
        reasons = []
        if numel < 2:
            reasons.append("one-element")
        else:
            if p_std == 0:
                reasons.append("zero-param-std")
            if u_std == 0:
                reasons.append("zero-update")
        if bad:
            reasons.append("nonfinite-grad")
        if not reasons and not (np.isfinite(p_std) and np.isfinite(u_std)):
            reasons.append("nonfinite")
        flags.append(",".join(reasons))
    return flags


def block_ratios(before: torch.Tensor | None, after: torch.Tensor | None, grad: torch.Tensor | None,
                 rows: int) -> dict[str, np.ndarray]:
    """All per-row statistics of one block of a parameter's history (tensors shaped (rows, *param_shape))."""
    nan = torch.full((rows,), float("nan"), dtype=torch.float64)
    param_std = row_std(before) if before is not None else nan
    param_norm = row_norm(before) if before is not None else nan
    if before is not None and after is not None:
        update = after.double() - before.double()
        update_std, update_norm = row_std(update), row_norm(update)
    else:
        update_std = update_norm = nan
    if grad is not None:
        grad_std, grad_norm = row_std(grad), row_norm(grad)
        grad_nonfinite = (~torch.isfinite(grad.reshape(rows, -1))).sum(dim=1)
    else:
        grad_std = grad_norm = nan
        grad_nonfinite = torch.zeros(rows, dtype=torch.int64)
    return {
        UPDATE_TO_DATA: update_to_data(update_std.numpy(), param_std.numpy()),
        GRAD_TO_DATA: grad_to_data(grad_std.numpy(), param_std.numpy()),
        "update_std": update_std.numpy(), "param_std": param_std.numpy(), "grad_std": grad_std.numpy(),
        "update_norm": update_norm.numpy(), "grad_norm": grad_norm.numpy(), "param_norm": param_norm.numpy(),
        "grad_nonfinite": grad_nonfinite.numpy(),
    }


# Elements per pass of the streaming sums: a few float64 temporaries of this size stay in the CPU cache.
SUM_CHUNK = 1 << 15
# A variance from sums whose mean^2 term cancels all but this fraction of the sum of squares is recomputed two-pass.
CANCELLATION = 1e-6


class Sums:
    """Streaming count, sum and sum of squares of one tensor (float64), chunk by chunk: the std and the norm in one
    pass over memory, without float64 copies of whole tensors."""

    __slots__ = ("n", "s1", "s2", "nonfinite")

    def __init__(self):
        self.n, self.s1, self.s2, self.nonfinite = 0, 0.0, 0.0, 0

    def add(self, x: torch.Tensor, count_nonfinite: bool = False) -> None:
        s1, s2 = float(x.sum()), float(torch.dot(x, x))
        self.n += x.numel()
        self.s1 += s1
        self.s2 += s2
        if count_nonfinite and not (math.isfinite(s1) and math.isfinite(s2)):
            self.nonfinite += int((~torch.isfinite(x)).sum())

    def std(self) -> float:
        """Unbiased std (torch.std), or None when the sums cancel too much to trust (recompute two-pass)."""
        if self.n < 2:
            return math.nan
        centered = self.s2 - self.s1 * self.s1 / self.n
        if not math.isfinite(centered):
            return math.nan
        if centered <= CANCELLATION * self.s2:
            return None
        return math.sqrt(centered / (self.n - 1))

    def norm(self) -> float:
        return math.sqrt(self.s2)


def _row_sums(before, after, grad) -> tuple[Sums, Sums, Sums]:
    """Sums of the parameter, the update (after - before) and the gradient of one recorded row (flat tensors in the
    stored dtype, any of them None), chunk by chunk."""
    out = (Sums(), Sums(), Sums())
    size = next(t.numel() for t in (before, after, grad) if t is not None)
    for lo in range(0, size, SUM_CHUNK):
        part = slice(lo, lo + SUM_CHUNK)
        b = before[part].double() if before is not None else None
        if b is not None:
            out[0].add(b)
            if after is not None:
                out[1].add(after[part].double().sub_(b))
        if grad is not None:
            out[2].add(grad[part].double(), count_nonfinite=True)
    return out


def _two_pass_std(x: torch.Tensor) -> float:
    return float(x.double().std()) if x.numel() >= 2 else math.nan


def _rows_ratios(p, rows: slice) -> dict[str, np.ndarray]:
    """block_ratios for rows of a parameter read with ``read_part``: one read per kind for all the rows, then the
    streaming sums of each row."""
    kinds = (schema.KIND_PARAM, schema.KIND_PARAM_AFTER, schema.KIND_GRAD)
    data = {k: (real_numbers(p.read_part(k, rows)).reshape(rows.stop - rows.start, -1) if k in p.kinds else None)
            for k in kinds}
    n = rows.stop - rows.start
    cols = {c: np.full(n, np.nan) for c in ("param_std", "update_std", "grad_std", "param_norm", "update_norm",
                                            "grad_norm")}
    grad_nonfinite = np.zeros(n, np.int64)
    for i in range(n):
        before, after, grad = (data[k][i] if data[k] is not None else None for k in kinds)
        if before is None and grad is None:
            continue
        sums = _row_sums(before, after if before is not None else None, grad)
        for name, s, tensor in (("param", sums[0], before), ("update", sums[1], None), ("grad", sums[2], grad)):
            if s.n == 0 and name != "update":
                continue
            if name == "update" and (before is None or after is None):
                continue
            std = s.std()
            if std is None:  # nearly constant: the sums cancel; the exact two-pass std
                exact = tensor if tensor is not None else after.double() - before.double()
                std = _two_pass_std(exact)
            cols[f"{name}_std"][i], cols[f"{name}_norm"][i] = std, s.norm()
        grad_nonfinite[i] = sums[2].nonfinite
    return {UPDATE_TO_DATA: update_to_data(cols["update_std"], cols["param_std"]),
            GRAD_TO_DATA: grad_to_data(cols["grad_std"], cols["param_std"]), **cols, "grad_nonfinite": grad_nonfinite}


def ratios_frame(run, block_bytes: int) -> pd.DataFrame:
    frames = []
    kinds = (schema.KIND_PARAM, schema.KIND_PARAM_AFTER, schema.KIND_GRAD)
    for opt in run.optimizers:
        for p in opt.param_records.values():
            if p.num_rows == 0:
                continue
            if hasattr(p, "read_part"):  # one file: rows read together, in the stored dtype, summed in chunks
                per_read = max(1, block_bytes // (4 * 3 * max(1, p.numel)))
                parts = ((rows, _rows_ratios(p, rows)) for rows in
                         (slice(lo, min(lo + per_read, p.num_rows)) for lo in range(0, p.num_rows, per_read)))
            else:  # a distributed job's stitched parameter
                parts = ((rows, block_ratios(block.get(schema.KIND_PARAM), block.get(schema.KIND_PARAM_AFTER),
                                             block.get(schema.KIND_GRAD), rows.stop - rows.start))
                         for rows, block in p.iter_blocks(kinds, block_bytes))
            for rows, stats in parts:
                records = p.records[rows]
                group = p.param_group if p.param_group is not None else 0
                lrs = opt.learning_rates
                lr = lrs[records, group] if lrs.ndim == 2 and group < lrs.shape[1] else np.nan
                df = pd.DataFrame({"optimizer": opt.index, "param": p.name, "record": records,
                                   "step": opt.steps[records], "lr": lr, "numel": p.numel, **stats})
                df["flag"] = ratio_flags(p.numel, stats["param_std"], stats["update_std"], stats["grad_nonfinite"])
                frames.append(df)
    if not frames:
        return pd.DataFrame(columns=RATIO_TABLE_COLUMNS)
    return pd.concat(frames, ignore_index=True)[RATIO_TABLE_COLUMNS]


def ratios_from_stats(stats: pd.DataFrame, numel: dict) -> pd.DataFrame:
    """The Run.ratios() table computed from the statistics (same columns; record is -1: no full-tensor record)."""
    if stats.empty:
        return pd.DataFrame(columns=RATIO_TABLE_COLUMNS)
    get = lambda c: stats[c] if c in stats else pd.Series(np.nan, index=stats.index)  # noqa: E731
    out = pd.DataFrame({
        "optimizer": stats["optimizer"], "param": stats["param"], "record": -1, "step": stats["step"],
        "lr": stats["lr"], "numel": [numel.get((o, p), 0) for o, p in zip(stats["optimizer"], stats["param"])],
        "update_to_data": get("update_to_data"), "grad_to_data": get("grad_to_data"),
        "update_std": get("update_std"), "param_std": get("param_std"), "grad_std": get("grad_std"),
        "update_norm": get("update_norm"), "grad_norm": get("grad_norm"), "param_norm": get("param_norm"),
        "grad_nonfinite": get("grad_nonfinite").fillna(0).astype(np.int64),
    })
    out["flag"] = [ratio_flags(n, [p], [u], [g])[0] for n, p, u, g in
                   zip(out["numel"], out["param_std"], out["update_std"], out["grad_nonfinite"])]
    return out[RATIO_TABLE_COLUMNS]


def ratios_table(reader, block_bytes: int, source: str, stats_rows: dict, stats_table) -> pd.DataFrame:
    """``ratios()`` of a Run or a Job: per optimizer, from the full tensors or from the statistics table.

    stats_rows: {optimizer index: committed statistics rows}; stats_table(): the statistics table (read only when
    it is used). source "auto" uses, per optimizer, whichever covers more steps."""
    if source not in ("auto", "tensors", "stats"):
        raise ValueError(f"source must be 'auto', 'tensors' or 'stats', got {source!r}")
    use_stats = {opt.index for opt in reader.optimizers if stats_rows.get(opt.index) and (
        source == "stats" or (source == "auto" and stats_rows[opt.index] > opt.num_records))}
    parts = []
    if len(use_stats) < len(reader.optimizers):
        tensors = ratios_frame(reader, block_bytes)
        parts.append(tensors[~tensors["optimizer"].isin(use_stats)])
    if use_stats:
        stats = stats_table()
        numel = {(r.optimizer, r.param): r.numel for r in reader.params().itertuples()}
        parts.append(ratios_from_stats(stats[stats["optimizer"].isin(use_stats)], numel))
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else ratios_frame(reader, block_bytes)
