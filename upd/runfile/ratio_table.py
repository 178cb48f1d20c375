"""Update:data and grad:data ratios of a run's stored tensors (``Run.ratios()``, ``Job.ratios()``): pure functions
on tensors, plus the streaming DataFrame builder.

torch is imported by the functions that use it, as in encoding.py: opening and listing a run (``upd info``) imports
no torch."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..ratios import GRAD_TO_DATA, UPDATE_TO_DATA, grad_to_data, real_numbers, update_to_data
from ..torch_threads import one_torch_thread
from . import schema, tensor_blocks

if TYPE_CHECKING:
    import torch

RATIO_TABLE_COLUMNS = ["optimizer", "param", "record", "step", "lr", "numel", "update_to_data", "grad_to_data",
                 "update_std", "param_std", "grad_std", "update_norm", "grad_norm", "param_norm",
                 "grad_nonfinite", "flag"]


def ratio_flags(numel: int, param_std, update_std, grad_nonfinite) -> list[str]:
    """Why a ratio is not a plain finite number, per row ('' when it is)."""
    param_std, update_std = np.asarray(param_std, np.float64), np.asarray(update_std, np.float64)
    grad_bad = np.asarray(grad_nonfinite) != 0
    if numel < 2:
        odd = np.ones(len(param_std), bool)
    else:
        odd = (param_std == 0) | (update_std == 0) | grad_bad | ~(np.isfinite(param_std) & np.isfinite(update_std))
    flags = [""] * len(param_std)
    for i in np.flatnonzero(odd):  # the few rows that need a reason
        reasons = []
        if numel < 2:
            reasons.append("one-element")
        else:
            if param_std[i] == 0:
                reasons.append("zero-param-std")
            if update_std[i] == 0:
                reasons.append("zero-update")
        if grad_bad[i]:
            reasons.append("nonfinite-grad")
        if not reasons and not (np.isfinite(param_std[i]) and np.isfinite(update_std[i])):
            reasons.append("nonfinite")
        flags[i] = ",".join(reasons)
    return flags


# Elements per pass of the streaming sums: a few float64 temporaries of this size stay in the CPU cache.
SUM_CHUNK = 1 << 16
# A variance from sums whose mean^2 term cancels all but this fraction of the sum of squares is recomputed two-pass.
CANCELLATION = 1e-6
STAT_COLUMNS = ("param_std", "update_std", "grad_std", "param_norm", "update_norm", "grad_norm")


def _add_sums(sums: torch.Tensor, x: torch.Tensor) -> None:
    """sums[:, 0] += each row's sum, sums[:, 1] += each row's sum of squares (x: float64, (rows, columns))."""
    sums[:, 0] += x.sum(1)
    sums[:, 1] += (x * x).sum(1)


class RowSums:
    """(sum, sum of squares) of the parameter, the update and the gradient of one long row, fed in pieces of any
    size (flat tensors in the stored dtype, any of them None): the numbers are gathered into reused float64 buffers
    and reduced SUM_CHUNK at a time, one dot product per chunk, so the sums do not depend on how the row was split
    (a whole row and the same row read block by block give the same bits) and no temporary is the size of a row."""

    def __init__(self):
        import torch

        self.buffers = [torch.empty(SUM_CHUNK, dtype=torch.float64) for _ in range(3)]
        self.filled = 0
        self.present = (False, False, False)
        self.acc = [0.0] * 6
        self.numbers = 0

    def add(self, before, after, grad) -> None:
        import torch

        if after is not None and before is None:
            after = None  # no update without the parameter before the step
        self.present = (before is not None, after is not None, grad is not None)
        size = next(t.numel() for t in (before, grad) if t is not None)
        self.numbers += size
        b, u, g = self.buffers
        at = 0
        while at < size:
            take = min(SUM_CHUNK - self.filled, size - at)
            into, part = slice(self.filled, self.filled + take), slice(at, at + take)
            if before is not None:
                b[into].copy_(before[part])
                if after is not None:
                    torch.sub(after[part], b[into], out=u[into])
            if grad is not None:
                g[into].copy_(grad[part])
            self.filled += take
            at += take
            if self.filled == SUM_CHUNK:
                self._reduce()

    def _reduce(self) -> None:
        import torch

        n, acc = self.filled, self.acc
        for k, (present, buffer) in enumerate(zip(self.present, self.buffers)):
            if present:
                x = buffer[:n]
                acc[2 * k] += float(x.sum())
                acc[2 * k + 1] += float(torch.dot(x, x))
        self.filled = 0

    def sums(self) -> np.ndarray:
        """(3, 2): (sum, sum of squares) of the parameter, the update and the gradient."""
        if self.filled:
            self._reduce()
        return np.reshape(self.acc, (3, 2))


def _stds(sums: np.ndarray, n: int) -> np.ndarray:
    """Unbiased std (torch.std) of each row from its (sum, sum of squares) over n numbers; NaN where the sums cancel
    too much to trust (the caller recomputes those two-pass) and where n < 2."""
    if n < 2:
        return np.full(len(sums), np.nan)
    s1, s2 = sums[:, 0], sums[:, 1]
    with np.errstate(invalid="ignore", over="ignore"):
        centered = s2 - s1 * s1 / n
        std = np.sqrt(np.maximum(centered, 0.0) / (n - 1))
    return np.where(np.isfinite(centered), std, np.nan)


def _two_pass_std(x: torch.Tensor) -> float:
    return float(x.double().std()) if x.numel() >= 2 else math.nan


def block_ratios(before: torch.Tensor | None, after: torch.Tensor | None, grad: torch.Tensor | None,
                 rows: int) -> dict[str, np.ndarray]:
    """All per-row statistics of one block of a parameter's history: tensors shaped (rows, *param_shape), in any
    floating dtype (the stored one: nothing is converted whole), any of them None.

    The std and norm of the parameter, its update (after - before) and its gradient come from float64 sums and sums
    of squares taken over every row at once, SUM_CHUNK numbers per pass (float64 temporaries that stay in the CPU
    cache); a row whose sums cancel (a nearly constant tensor: |mean| >> std) gets the exact two-pass std."""
    import torch

    data = [None if t is None else real_numbers(t).reshape(rows, -1) for t in (before, after, grad)]
    before, after, grad = data
    if before is None:
        after = None  # no update without the parameter before the step
    cols = {c: np.full(rows, np.nan) for c in STAT_COLUMNS}
    grad_nonfinite = np.zeros(rows, np.int64)
    present = [t for t in (before, grad) if t is not None]
    n = present[0].shape[1] if present else 0
    if rows and n:
        if n >= SUM_CHUNK:  # long rows: one row at a time, a dot product per chunk
            sums = np.zeros((3, rows, 2))
            for i in range(rows):
                row = RowSums()
                row.add(*(None if t is None else t[i] for t in (before, after, grad)))
                sums[:, i] = row.sums()
        else:  # short rows: every row at once, a few operations per chunk of rows
            sums = torch.zeros(3, rows, 2, dtype=torch.float64)  # param, update, grad x (sum, sum of squares)
            width = max(1, SUM_CHUNK // rows)
            for lo in range(0, n, width):
                part = slice(lo, lo + width)
                if before is not None:
                    b = before[:, part].double()
                    _add_sums(sums[0], b)
                    if after is not None:
                        _add_sums(sums[1], after[:, part].double().sub_(b))
                if grad is not None:
                    _add_sums(sums[2], grad[:, part].double())
            sums = sums.numpy()
        exact = {0: lambda i: _two_pass_std(before[i]),
                 1: lambda i: _two_pass_std(after[i].double() - before[i].double()),
                 2: lambda i: _two_pass_std(grad[i])}
        cols, grad_nonfinite = _stats_from_sums(sums, n, (before is not None, after is not None, grad is not None),
                                                exact, lambda i: int((~torch.isfinite(grad[i])).sum()))
    return _with_ratios(cols, grad_nonfinite)


def _stats_from_sums(sums: np.ndarray, n: int, present: tuple, exact_std, count_nonfinite) -> tuple[dict, np.ndarray]:
    """The std and norm columns and the non-finite gradient counts of rows from their sums (3, rows, 2: parameter,
    update, gradient x (sum, sum of squares)) over n numbers each. exact_std[k](row): the two-pass std of quantity
    k at a row whose sums cancel; count_nonfinite(row): the NaN/Inf elements of a gradient whose sums are not finite
    (both rare, so asked for only when needed)."""
    rows = sums.shape[1]
    cols = {c: np.full(rows, np.nan) for c in STAT_COLUMNS}
    grad_nonfinite = np.zeros(rows, np.int64)
    for k, name in enumerate(("param", "update", "grad")):
        if not present[k]:
            continue
        std = _stds(sums[k], n)
        with np.errstate(invalid="ignore", over="ignore"):
            centered = sums[k][:, 1] - sums[k][:, 0] ** 2 / n
            cancels = np.isfinite(centered) & (centered <= CANCELLATION * sums[k][:, 1]) & (n >= 2)
        for i in np.flatnonzero(cancels):  # nearly constant: the sums cancel; the exact two-pass std
            std[i] = exact_std[k](i)
        cols[f"{name}_std"], cols[f"{name}_norm"] = std, np.sqrt(sums[k][:, 1])
    if present[2]:
        for i in np.flatnonzero(~np.isfinite(sums[2]).all(1)):  # non-finite sums: count the elements
            grad_nonfinite[i] = count_nonfinite(i)
    return cols, grad_nonfinite


def _with_ratios(cols: dict, grad_nonfinite: np.ndarray) -> dict[str, np.ndarray]:
    return {UPDATE_TO_DATA: update_to_data(cols["update_std"], cols["param_std"]),
            GRAD_TO_DATA: grad_to_data(cols["grad_std"], cols["param_std"]), **cols, "grad_nonfinite": grad_nonfinite}


def _rows_ratios(p, rows: slice) -> dict[str, np.ndarray]:
    """block_ratios for rows of a parameter read with ``read_part``: one read per kind for all the rows, in the
    stored dtype."""
    kinds = (schema.KIND_PARAM, schema.KIND_PARAM_AFTER, schema.KIND_GRAD)
    data = [p.read_part(k, rows) if k in p.kinds else None for k in kinds]
    return block_ratios(*data, rows.stop - rows.start)


def _long_row_ratios(p, row: int, elements: int) -> dict[str, np.ndarray]:
    """block_ratios of one row of a parameter larger than a block, read with ``read_part`` at most `elements` of
    each kind at a time: memory is bounded by the block, not by the parameter.

    The sums are the whole row's to the bit (RowSums reduces the same SUM_CHUNK numbers in the same order however
    the row is split). The two rare extra passes read the row again block by block: the std of a row whose sums
    cancel is the two-pass std about the mean of the first pass (equal to ``torch.std`` of the whole row to float64
    rounding), and a gradient whose sums are not finite has its NaN/Inf elements counted."""
    import torch


    kinds = [k if k in p.kinds else None for k in (schema.KIND_PARAM, schema.KIND_PARAM_AFTER, schema.KIND_GRAD)]
    if kinds[0] is None:
        kinds[1] = None  # no update without the parameter before the step
    if kinds[0] is None and kinds[2] is None:
        return block_ratios(None, None, None, 1)
    indexes = tensor_blocks.element_blocks(p.stored_shape(kinds[0] or kinds[2]), elements)  # as verify reads them
    rows = slice(row, row + 1)

    def pieces(wanted=(0, 1, 2)):
        """[parameter, parameter after, gradient] (flat, stored dtype; None: absent or not wanted) of each block."""
        for index in indexes:
            yield [None if kind is None or k not in wanted else real_numbers(p.read_part(kind, rows, index)).reshape(-1)
                   for k, kind in enumerate(kinds)]

    acc = RowSums()
    for before, after, grad in pieces():
        acc.add(before, after, grad)
    sums, n = acc.sums()[:, None, :], acc.numbers

    def two_pass_std(k: int) -> float:
        if n < 2:
            return math.nan
        mean, squares = sums[k, 0, 0] / n, 0.0
        for before, after, grad in pieces((0, 1) if k == 1 else (k,)):
            x = after.double() - before.double() if k == 1 else (before if k == 0 else grad).double()
            squares += float(x.sub_(mean).square_().sum())
        return math.sqrt(squares / (n - 1))

    cols, grad_nonfinite = _stats_from_sums(
        sums, n, tuple(kind is not None for kind in kinds), {k: (lambda i, k=k: two_pass_std(k)) for k in range(3)},
        lambda i: sum(int((~torch.isfinite(grad)).sum()) for _, _, grad in pieces((2,))))
    return _with_ratios(cols, grad_nonfinite)


def ratios_frame(run, block_bytes: int) -> pd.DataFrame:
    """The ratio table of every full-tensor record: one row per (optimizer, parameter, record), built as one
    DataFrame from the columns of every block (not one DataFrame per block)."""
    with one_torch_thread():
        return _ratios_frame(run, block_bytes)


def _ratios_frame(run, block_bytes: int) -> pd.DataFrame:

    parts = []  # (optimizer, param, numel, records, steps, lr, stats)
    kinds = (schema.KIND_PARAM, schema.KIND_PARAM_AFTER, schema.KIND_GRAD)
    # Elements of one row read per kind at once, at most verify's block: a larger row is read in parts (reading
    # through the checked file object holds about two copies of what is read, and smaller reads stay in the cache).
    elements = max(1, min(block_bytes // (4 * 3), tensor_blocks.BLOCK_ELEMENTS))
    for opt in run.optimizers:
        lrs = opt.learning_rates
        for p in opt.param_records.values():
            if p.num_rows == 0:
                continue
            if hasattr(p, "read_part") and p.numel <= elements:  # one file: rows read together, in the stored dtype
                per_read = max(1, block_bytes // (4 * 3 * max(1, p.numel)))
                blocks = ((rows, _rows_ratios(p, rows)) for rows in
                          (slice(lo, min(lo + per_read, p.num_rows)) for lo in range(0, p.num_rows, per_read)))
            elif hasattr(p, "read_part"):  # a row larger than a block: each row read a block of elements at a time
                blocks = ((slice(i, i + 1), _long_row_ratios(p, i, elements)) for i in range(p.num_rows))
            else:  # a distributed job's stitched parameter
                blocks = ((rows, block_ratios(block.get(schema.KIND_PARAM), block.get(schema.KIND_PARAM_AFTER),
                                              block.get(schema.KIND_GRAD), rows.stop - rows.start))
                          for rows, block in p.iter_blocks(kinds, block_bytes))
            group = p.param_group if p.param_group is not None else 0
            for rows, stats in blocks:
                records = p.records[rows]
                lr = lrs[records, group] if lrs.ndim == 2 and group < lrs.shape[1] else np.full(len(records), np.nan)
                stats["flag"] = ratio_flags(p.numel, stats["param_std"], stats["update_std"], stats["grad_nonfinite"])
                parts.append((opt.index, p.name, p.numel, records, opt.steps[records], lr, stats))
    if not parts:
        return pd.DataFrame(columns=RATIO_TABLE_COLUMNS)
    counts = [len(part[3]) for part in parts]
    columns = {
        "optimizer": np.repeat([part[0] for part in parts], counts),
        "param": np.repeat(np.array([part[1] for part in parts], dtype=object), counts),
        "record": np.concatenate([part[3] for part in parts]),
        "step": np.concatenate([part[4] for part in parts]),
        "lr": np.concatenate([np.asarray(part[5]) for part in parts]),
        "numel": np.repeat([part[2] for part in parts], counts),
    }
    for name in RATIO_TABLE_COLUMNS[6:]:
        if name == "flag":
            columns[name] = [flag for part in parts for flag in part[6]["flag"]]
        else:
            columns[name] = np.concatenate([part[6][name] for part in parts])
    return pd.DataFrame(columns)[RATIO_TABLE_COLUMNS]


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
