"""Comparing runs: after one analysis the next question is "and with the other init, the other lr?".

Each run is analyzed as ``upd analyze`` would; the runs are then lined up per weight, matched by optimizer index
and parameter name: a table of the median ratios side by side with their differences from the first run, and one
figure per quantity in which each weight's panel overlays the runs (the learning rate and the loss first, on the
same step axis, since a different schedule is the usual reason two runs' ratios differ).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pandas as pd

from ..outputs import input_files, make_output_dir, open_output, refuse_inputs, write_csv
from ..runfile.job import Job
from ..runfile.reader import Run
from ..runfile.opening import open_run
from ..safe_text import text_table
from .summary import FLAGGED_STATUSES, Thresholds, is_weight, model_order_keys, summarize

QUANTITIES = {"update_to_data": "median_update_to_data", "grad_to_data": "median_grad_to_data"}
TABLE_CSV = "compare.csv"


def figure_name(column: str) -> str:
    return f"compare_{column}.png"


@dataclass
class Comparison:
    labels: list  # one per run, in the order given: the names the table's columns and the legends use
    ratios: pd.DataFrame  # every run's Run.ratios(), with a "run" column (its label) first
    summaries: pd.DataFrame  # every run's per-parameter summary, with a "run" column first
    plots: list = field(default_factory=list)  # PNG paths written
    images: dict = field(default_factory=dict)  # {file name: PNG bytes} of every figure drawn

    def table(self, quantity: str = "update_to_data", all_params: bool = False) -> pd.DataFrame:
        """One row per weight (every parameter with all_params), in model order: the median of `quantity` per
        run side by side, then each run's difference from the first (log10: +1 is ten times larger)."""
        return median_table(self.summaries, self.labels, quantity, all_params)


def run_labels(paths: list[str]) -> list[str]:
    """Short, distinct names for runs: the file name without .h5, with as much of its folder as tells them apart."""
    parts = [os.path.normpath(os.fspath(p)).split(os.sep) for p in paths]

    def at_depth(depth: int) -> list[str]:
        labels = ["/".join(p[-depth:]) for p in parts]
        return [label[:-3] if label.endswith(".h5") else label for label in labels]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = at_depth(depth)
        if len(set(labels)) == len(labels):
            return labels
    return [f"{label} #{i + 1}" for i, label in enumerate(at_depth(1))]  # the same file more than once


def median_table(summaries: pd.DataFrame, labels: list[str], quantity: str = "update_to_data",
                 all_params: bool = False) -> pd.DataFrame:
    """See Comparison.table. summaries: Comparison.summaries."""
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {', '.join(QUANTITIES)}, got {quantity!r}")
    column = QUANTITIES[quantity]
    keys = []
    for label in labels:
        part = summaries[summaries["run"] == label]
        keys += [k for k in zip(part["optimizer"], part["param"]) if k not in set(keys)]
    shapes = {}
    for r in summaries.itertuples():
        shapes.setdefault((r.optimizer, r.param), r.shape)
    if not all_params:
        keys = [k for k in keys if is_weight(_shape_tuple(shapes[k]))]
    table = pd.DataFrame({"optimizer": [k[0] for k in keys], "param": [k[1] for k in keys],
                          "shape": [shapes[k] for k in keys]})
    for label in labels:
        part = summaries[summaries["run"] == label].set_index(["optimizer", "param"])[column]
        table[label] = [part.get(k, float("nan")) for k in keys]
    for label in labels[1:]:
        table[f"{label} - {labels[0]}"] = table[label] - table[labels[0]]
    return table


def _shape_tuple(shape: str) -> tuple:
    """A summary's shape text ('20x64', 'scalar') back as a tuple, for is_weight."""
    return () if shape in ("scalar", "") else tuple(shape.split("x"))


def compare(runs, labels: list[str] | None = None, *, out_dir=None, plots: bool | None = None,
            thresholds: Thresholds = Thresholds(), all_params: bool = False) -> Comparison:
    """Analyze each run (paths, or open Runs or Jobs) and line them up per weight; see Comparison.

    labels: the runs' names (default: their file names, see run_labels). plots: draw one figure per quantity
    (default: when out_dir is given). out_dir: write compare.csv (the update:data table) there, and the PNGs."""
    runs = list(runs)
    if len(runs) < 2:
        raise ValueError(f"compare needs at least two runs, got {len(runs)}")
    if labels is None:
        labels = run_labels([r.path if isinstance(r, (Run, Job)) else r for r in runs])
    labels = [str(label) for label in labels]
    if len(labels) != len(runs) or len(set(labels)) != len(labels):
        raise ValueError(f"need {len(runs)} distinct labels, one per run, got {labels}")
    plots = out_dir is not None if plots is None else plots
    ratios, summaries, params, scalars = {}, {}, {}, {}
    for label, run in zip(labels, runs):
        own = not isinstance(run, (Run, Job))
        opened = open_run(run) if own else run
        try:
            params[label] = opened.params()
            ratios[label] = opened.ratios()
            summaries[label] = summarize(ratios[label], params[label], thresholds)
            scalars[label] = opened.scalars() if hasattr(opened, "scalars") else None
        finally:
            if own:
                opened.close()
    comparison = Comparison(
        labels=labels,
        ratios=pd.concat([r.assign(run=label)[["run", *r.columns]] for label, r in ratios.items()],
                         ignore_index=True),
        summaries=pd.concat([s.assign(run=label)[["run", *s.columns]] for label, s in summaries.items()],
                            ignore_index=True))
    if plots:
        from .plots import compare_figure, png_bytes  # matplotlib is imported only when plots are asked for

        keys = []
        for label in labels:
            keys += [k for k in model_order_keys(params[label], ratios[label]) if k not in set(keys)]
        shapes = {}
        for label in labels:
            for r in params[label].itertuples():
                shapes.setdefault((r.optimizer, r.param), r.shape)
        keys = [k for k in keys if all_params or is_weight(shapes.get(k, ()))]
        flagged = {(r.optimizer, r.param) for r in comparison.summaries.itertuples()
                   if r.status in FLAGGED_STATUSES}
        for column in QUANTITIES:
            table = comparison.table(column, all_params=True).set_index(["optimizer", "param"])
            spread = {k: (table.loc[k, labels].max() - table.loc[k, labels].min()) if k in table.index else 0.0
                      for k in keys}
            update = column == "update_to_data"
            fig = compare_figure(ratios, params, keys, column, scalars=scalars,
                                 thresholds=thresholds if update else None, guide=thresholds.target if update else None,
                                 priority=flagged, spread=spread)
            comparison.images[figure_name(column)] = png_bytes(fig)
    if out_dir is not None:
        make_output_dir(out_dir)
        # no output replaces an input: every name written here, checked before the first is written
        refuse_inputs([os.path.join(out_dir, name) for name in [*comparison.images, TABLE_CSV]],
                      input_files([r.path if isinstance(r, (Run, Job)) else r for r in runs]))
        for name, png in comparison.images.items():
            path = os.path.join(out_dir, name)
            with open_output(path) as f:  # never through a link planted under that name
                f.write(png)
            comparison.plots.append(path)
        write_csv(comparison.table("update_to_data", all_params), os.path.join(out_dir, TABLE_CSV))
    return comparison


def format_comparison(table: pd.DataFrame, wide: bool = False) -> str:
    """A comparison table as aligned text, ratios to 2 decimals, differences signed; names shortened to fit 100
    columns unless `wide` (upd.safe_text.text_table)."""
    if table.empty:
        return "(no weight in any run)"
    shown = table.drop(columns=["optimizer"]) if table["optimizer"].nunique() == 1 else table.copy()
    formatters = {c: (lambda v: f"{v:+.2f}" if v == v else "-") for c in shown.columns if " - " in str(c)}
    return text_table(shown, formats=formatters, keep=[c for c in shown.columns if c != "shape"], wide=wide,
                      wrap_headers=False)  # "bad - good" reads as one
