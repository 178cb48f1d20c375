"""TensorBoard output: update:data and grad:data ratios and norms as scalars, live or from a finished run.

    sink = TensorBoardSink("runs/tb")                  # or TensorBoardSink(existing_summary_writer)
    sink.write(step, {"fc1.weight": {"update_to_data": -3.1, "grad_to_data": -1.2, ...}, ...})
    sink.close()

    export_ratios(upd.open_run("run.h5").ratios(), "runs/tb")   # a finished run, same tags
    export_run(upd.open_run("run.h5"), "runs/tb")                # the ratios and the logged scalars

Tags are ``<column>/<param>`` for the columns in ``TAGS`` (TensorBoard groups them into one section per column),
at ``global_step=step``; logged scalars (``rec.log``, the total gradient norms) are ``scalars/<name>``. Missing
and non-finite values (a one-element parameter's std, a zero update's log10) are skipped, never written as NaN/inf.
tensorboard itself is imported only when a writer has to be created from a path.

In a distributed job the recorder writes from rank 0 alone, the whole parameters' values: where each rank holds a
part of the model, ``upd.recorder.job_scalars`` combines the ranks' statistics of the kinds these TAGS are made of.
"""
from __future__ import annotations

import math
import os
from typing import Mapping

# The columns written, in this order, each as "<column>/<param>".
TAGS = ("update_to_data", "grad_to_data", "update_norm", "grad_norm", "param_norm")
SCALARS_SECTION = "scalars"  # logged scalars are "scalars/<name>" (optimizer k > 0: "scalars/opt<k>:<name>")

# Works before torch-upd itself is installed from a clone, where "torch-upd[tensorboard]" cannot be resolved.
INSTALL_HINT = 'pip install tensorboard, or from a clone of torch-upd: pip install ".[tensorboard]"'

# TensorBoard stores scalars as float32 (simple_value): a larger finite double would be written as inf.
_FLOAT32_MAX = 3.4028234663852886e38


def _summary_writer_class():
    """torch's SummaryWriter, or an ImportError that says how to install what is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(f"TensorBoard output needs the tensorboard package, which is not installed or not "
                          f"usable ({exc}): {INSTALL_HINT}") from exc
    return SummaryWriter


def _finite(value) -> float | None:
    """value as a float when it is a finite number TensorBoard can store, else None."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
        return None
    return v


class TensorBoardSink:
    """Writes per-parameter ratio statistics to TensorBoard.

    ``target`` is a ``torch.utils.tensorboard.SummaryWriter`` (or any object with its ``add_scalar``), used as is
    and never closed here, or a log-dir path, for which a SummaryWriter is created and owned (closed by
    ``close()``). Usable as a context manager.
    """

    def __init__(self, target):
        if isinstance(target, (str, bytes, os.PathLike)):
            self.writer = _summary_writer_class()(log_dir=os.fsdecode(target))
            self.owns_writer = True
        elif callable(getattr(target, "add_scalar", None)):
            self.writer = target
            self.owns_writer = False
        else:
            raise TypeError(f"TensorBoardSink target must be a SummaryWriter or a log-dir path, "
                            f"not {type(target).__name__}")
        self.closed = False

    def write(self, step: int, stats: Mapping[str, Mapping[str, float]], walltime: float | None = None) -> int:
        """Write one step: ``stats`` maps parameter name -> {column: value}. Returns the number of scalars written.

        Names are opaque (``"opt1:fc1.weight"`` is written as is). Columns other than ``TAGS`` are ignored;
        missing, None and non-finite values are skipped.
        """
        if self.closed:
            raise ValueError("TensorBoardSink is closed")
        step = int(step)
        written = 0
        for name, columns in stats.items():
            for column in TAGS:
                value = _finite(columns.get(column))
                if value is None:
                    continue
                self.writer.add_scalar(f"{column}/{name}", value, global_step=step, walltime=walltime)
                written += 1
        return written

    def write_scalars(self, step: int, values: Mapping[str, float], prefix: str = "",
                      walltime: float | None = None) -> int:
        """Write one step's logged scalars as ``scalars/<prefix><name>``; non-finite values are skipped. Returns the
        number written."""
        if self.closed:
            raise ValueError("TensorBoardSink is closed")
        written = 0
        for name, raw in values.items():
            value = _finite(raw)
            if value is not None:
                self.writer.add_scalar(f"{SCALARS_SECTION}/{prefix}{name}", value, global_step=int(step),
                                       walltime=walltime)
                written += 1
        return written

    def flush(self) -> None:
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()

    def close(self) -> None:
        """Close the writer if this sink created it; a user's writer is only flushed. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.owns_writer:
            self.writer.close()
        else:
            self.flush()

    def __enter__(self) -> "TensorBoardSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = getattr(self.writer, "log_dir", None) or type(self.writer).__name__
        return f"<TensorBoardSink {where}{' (closed)' if self.closed else ''}>"


def export_run(run, target) -> int:
    """Write a finished run to TensorBoard as the live recorder would have: its ratios (``run.ratios()``) and its
    logged scalars (``run.scalars()``). Returns the number of scalars written."""
    return export_tables(run.ratios(), run.scalars(), target)


def export_tables(ratios, scalars, target) -> int:
    """Write a ratios table and a logged-scalars table to one TensorBoard writer; returns the scalars written."""
    sink = target if isinstance(target, TensorBoardSink) else TensorBoardSink(target)
    try:
        return export_ratios(ratios, sink) + export_scalars(scalars, sink)
    finally:
        if sink is not target:
            sink.close()


def export_scalars(scalars, target) -> int:
    """Write a logged-scalars table (``Run.scalars()``) to TensorBoard, tags as the live recorder writes them."""
    missing = [c for c in ("optimizer", "step") if c not in scalars.columns]
    if missing:
        raise ValueError(f"not a scalars table: missing column(s) {', '.join(missing)}")
    sink = target if isinstance(target, TensorBoardSink) else TensorBoardSink(target)
    names = [c for c in scalars.columns if c not in ("optimizer", "step", "wall_time")]
    written = 0
    try:
        walls = scalars["wall_time"].tolist() if "wall_time" in scalars.columns else [None] * len(scalars)
        for optimizer, step, wall, values in zip(scalars["optimizer"].tolist(), scalars["step"].tolist(), walls,
                                                 scalars[names].to_numpy(dtype=float).tolist()):
            written += sink.write_scalars(int(step), dict(zip(names, values)),
                                          prefix=f"opt{int(optimizer)}:" if int(optimizer) else "", walltime=wall)
    finally:
        if sink is not target:
            sink.close()
    return written


def export_ratios(ratios, target) -> int:
    """Write a finished run's ratios table (``Run.ratios()``) to TensorBoard; returns the number of scalars written.

    One ``write`` per step, in step order. Parameters of optimizer k > 0 are named ``f"opt{k}:{param}"``, as the
    live recorder names them when several optimizers are recorded. ``target`` as for ``TensorBoardSink``; a
    writer created from a path is closed at the end, a given writer is flushed and left open.
    """
    missing = [c for c in ("optimizer", "param", "step") if c not in ratios.columns]
    if missing:
        raise ValueError(f"not a ratios table: missing column(s) {', '.join(missing)}")
    sink = target if isinstance(target, TensorBoardSink) else TensorBoardSink(target)
    written = 0
    try:
        if len(ratios):
            columns = [c for c in TAGS if c in ratios.columns]
            for step, rows in ratios.groupby("step", sort=True):  # in step order, rows in table order
                stats = {}
                for optimizer, param, *values in rows[["optimizer", "param", *columns]].itertuples(index=False):
                    name = f"opt{int(optimizer)}:{param}" if int(optimizer) > 0 else str(param)
                    stats[name] = dict(zip(columns, values))
                written += sink.write(int(step), stats)
    finally:
        if sink is not target:
            sink.close()
    return written
