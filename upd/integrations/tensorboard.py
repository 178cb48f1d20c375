"""TensorBoard output of a finished run, with the tags the live sink (``upd.sinks.TensorBoard``) writes:

    export_ratios(upd.open_run("run.h5").ratios(), "runs/tb")   # a finished run's ratios
    export_run(upd.open_run("run.h5"), "runs/tb")                # the ratios and the logged scalars

Tags are ``<column>/<param>`` for the columns in ``TAGS`` at ``global_step=step``; logged scalars (``rec.log``, the
total gradient norms) are ``scalars/<name>``; optimizer k > 0's are prefixed ``opt<k>:``. Missing and non-finite
values are skipped. tensorboard itself is imported only when a writer has to be created from a path.
"""
from __future__ import annotations

from ..sinks.base import LIVE_COLUMNS, SinkStep
from ..sinks.tensorboard import INSTALL_HINT, TensorBoard

TAGS = LIVE_COLUMNS  # the columns written, in this order, each as "<column>/<param>"

__all__ = ["INSTALL_HINT", "TAGS", "TensorBoard", "export_ratios", "export_run", "export_scalars", "export_tables"]


def _sink(target) -> TensorBoard:
    """A given TensorBoard sink as it is, else a sink writing to `target` (a SummaryWriter or a log dir)."""
    return target if isinstance(target, TensorBoard) else TensorBoard(target)


def export_run(run, target) -> int:
    """Write a finished run to TensorBoard as the live recorder would have: its ratios (``run.ratios()``) and its
    logged scalars (``run.scalars()``). Returns the number of scalars written."""
    return export_tables(run.ratios(), run.scalars(), target)


def export_tables(ratios, scalars, target) -> int:
    """Write a ratios table and a logged-scalars table to one TensorBoard writer; returns the scalars written."""
    sink = _sink(target)
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
    sink = _sink(target)
    names = [c for c in scalars.columns if c not in ("optimizer", "step", "wall_time")]
    before = sink.written
    try:
        walls = scalars["wall_time"].tolist() if "wall_time" in scalars.columns else [None] * len(scalars)
        sink.write([SinkStep(optimizer=int(optimizer), step=int(step), wall_time=wall, scalars=dict(zip(names, values)))
                    for optimizer, step, wall, values in zip(scalars["optimizer"].tolist(), scalars["step"].tolist(),
                                                             walls, scalars[names].to_numpy(dtype=float).tolist())])
    finally:
        if sink is not target:
            sink.close()
    return sink.written - before


def export_ratios(ratios, target) -> int:
    """Write a finished run's ratios table (``Run.ratios()``) to TensorBoard; returns the number of scalars written.

    One ``write`` per step, in step order. Parameters of optimizer k > 0 are named ``f"opt{k}:{param}"``, as the
    live recorder names them when several optimizers are recorded. ``target`` as for ``upd.sinks.TensorBoard``; a
    writer created from a path is closed at the end, a given writer is flushed and left open.
    """
    missing = [c for c in ("optimizer", "param", "step") if c not in ratios.columns]
    if missing:
        raise ValueError(f"not a ratios table: missing column(s) {', '.join(missing)}")
    sink = _sink(target)
    before = sink.written
    try:
        if len(ratios):
            columns = [c for c in TAGS if c in ratios.columns]
            for step, rows in ratios.groupby("step", sort=True):  # in step order, rows in table order
                params: dict[int, dict] = {}
                for optimizer, param, *values in rows[["optimizer", "param", *columns]].itertuples(index=False):
                    params.setdefault(int(optimizer), {})[str(param)] = dict(zip(columns, values))
                sink.write([SinkStep(optimizer=optimizer, step=int(step), wall_time=None, params=values)
                            for optimizer, values in params.items()])
    finally:
        if sink is not target:
            sink.close()
    return sink.written - before
