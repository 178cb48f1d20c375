"""TensorBoard as a live sink: ``upd.record(..., sinks=[upd.sinks.TensorBoard("runs/tb")])``, or the shorthand
``upd.record(..., tensorboard="runs/tb")``.

Tags are ``upd.sinks.base.metrics``' names: ``<column>/<param>`` for the ``LIVE_COLUMNS`` (TensorBoard groups them
into one section per column) and ``scalars/<name>`` for logged scalars, at ``global_step=step``; parameters and
scalars of optimizer k > 0 are prefixed ``opt<k>:``. Missing and non-finite values (a one-element parameter's std,
a zero update's log10) are skipped, never written as NaN/inf. tensorboard itself is imported only when a writer has
to be created from a path.
"""
from __future__ import annotations

import os
from typing import Sequence

from .base import SinkStep, metrics

# Works before torch-upd itself is installed from a clone, where "torch-upd[tensorboard]" cannot be resolved.
INSTALL_HINT = 'pip install tensorboard, or from a clone of torch-upd: pip install ".[tensorboard]"'

# TensorBoard stores scalars as float32 (simple_value): a larger finite double would be written as inf.
FLOAT32_MAX = 3.4028234663852886e38


def summary_writer_class():
    """torch's SummaryWriter, or an ImportError that says how to install what is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(f"TensorBoard output needs the tensorboard package, which is not installed or not "
                          f"usable ({exc}): {INSTALL_HINT}") from exc
    return SummaryWriter


class TensorBoard:
    """A sink writing each step's ratios, norms and logged scalars to TensorBoard.

    ``target`` is a ``torch.utils.tensorboard.SummaryWriter`` (or any object with its ``add_scalar``), used as is
    and only flushed by ``close()``, or a log-dir path, for which a SummaryWriter is created and owned (closed by
    ``close()``). Usable as a context manager.
    """

    def __init__(self, target):
        if isinstance(target, (str, bytes, os.PathLike)):
            self.writer = summary_writer_class()(log_dir=os.fsdecode(target))
            self.owns_writer = True
        elif callable(getattr(target, "add_scalar", None)):
            self.writer = target
            self.owns_writer = False
        else:
            raise TypeError(f"a TensorBoard sink's target must be a SummaryWriter or a log-dir path, "
                            f"not {type(target).__name__}")
        self.closed = False
        self.written = 0  # scalars written so far

    def write(self, steps: Sequence[SinkStep]) -> None:
        if self.closed:
            raise ValueError("this TensorBoard sink is closed")
        for step in steps:
            for tag, value in metrics(step, limit=FLOAT32_MAX).items():
                self.writer.add_scalar(tag, value, global_step=int(step.step), walltime=step.wall_time)
                self.written += 1

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

    def __enter__(self) -> "TensorBoard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = getattr(self.writer, "log_dir", None) or type(self.writer).__name__
        return f"<upd.sinks.TensorBoard {where}{' (closed)' if self.closed else ''}>"
