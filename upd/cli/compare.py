"""`upd compare A B ...`: runs side by side, per weight.

A command of its own rather than `upd analyze A B`: analyze's options are about one run (the histograms' --step,
the per-step --csv, --tensorboard, the --html report with --verify), and its output is one run's table; a
comparison has another table (the runs' medians side by side and their differences) and other figures (the runs
overlaid per weight)."""
from __future__ import annotations

import os

import click

from ..analyzer.compare import QUANTITIES, TABLE_CSV, compare as compare_runs, format_comparison
from ..analyzer.report import VERDICT_NAMES
from ..analyzer.summary import Thresholds
from .analyze import make_folder
from ..outputs import derived_folder, input_files, refuse_inputs
from ..safe_text import shorten
from .common import WIDE_OPTION, fail


@click.command()
@click.argument("runs", nargs=-1, required=True, metavar="RUN RUN...",
                type=click.Path(dir_okay=True, readable=False, path_type=str))
@click.option("--label", "labels", multiple=True, metavar="NAME",
              help="A name for each run, in order (repeat once per run). Default: the file names.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the figures (compare_update_to_data.png, compare_grad_to_data.png) and compare.csv "
                   "(created if missing, never emptied). Default: the first RUN's name without .h5, plus '-compare'.")
@click.option("--quantity", type=click.Choice(list(QUANTITIES)), default="update_to_data", show_default=True,
              help="Which median ratio the printed table compares.")
@click.option("--high", type=float, default=Thresholds.high, show_default=True,
              help="Flag a weight whose median update:data ratio (log10) is above this (marked in the figures).")
@click.option("--low", type=float, default=Thresholds.low, show_default=True,
              help="Flag a weight whose median update:data ratio (log10) is below this.")
@click.option("--all-params", is_flag=True, help="Biases and norm scales too, not only weights (ndim >= 2).")
@click.option("--no-plots", is_flag=True, help="Print the table only (and write compare.csv when --out is given).")
@WIDE_OPTION
def compare(runs, labels, out_dir, quantity, high, low, all_params, no_plots, wide):
    """Compare two or more runs (good init vs bad init, lr A vs lr B) weight by weight.

    Prints one row per weight, in model order, with each run's median ratio over its recorded steps (log10) side by
    side and each run's difference from the first (+1: ten times larger). Writes one figure per quantity in which
    each weight's panel overlays the runs, after the learning rate and the logged loss on the same step axis.
    Weights are matched by name (and optimizer index); one a run lacks shows as '-'.
    """
    if len(runs) < 2:
        fail("compare needs at least two runs (upd compare A B ...); for one run: upd analyze RUN")
    if labels and len(labels) != len(runs):
        fail(f"--label given {len(labels)} time(s) for {len(runs)} runs: give one per run, or none")
    if labels and len(set(labels)) != len(labels):
        fail("--label names must differ")
    try:
        thresholds = Thresholds(high=high, low=low)
    except ValueError as exc:
        fail(str(exc))
    if out_dir is None and not no_plots:
        out_dir = derived_folder(runs[0], "-compare")
    if out_dir is not None:
        refuse_inputs([os.path.join(out_dir, TABLE_CSV)], input_files(runs))
        make_folder(out_dir, "--out")
    comparison = compare_runs(list(runs), list(labels) or None, out_dir=out_dir, plots=not no_plots,
                              thresholds=thresholds, all_params=all_params)
    click.echo(f"median {quantity.replace('_to_', ':')} (log10) per weight; differences from {comparison.labels[0]}")
    click.echo(format_comparison(comparison.table(quantity, all_params), wide=wide))  # names shown escaped, bounded
    flagged = comparison.summaries[comparison.summaries["status"].isin(["HIGH", "LOW"])]
    for label in comparison.labels:
        part = flagged[flagged["run"] == label]
        if len(part):
            more = f", and {len(part) - VERDICT_NAMES} more" if len(part) > VERDICT_NAMES else ""
            click.echo(f"{label}: {len(part)} weight(s) flagged: "
                       + ", ".join(f"{shorten(r.param)} {r.status}" for r in part.head(VERDICT_NAMES).itertuples())
                       + more)
    if out_dir is not None:
        click.echo(f"figures and {TABLE_CSV} in {out_dir}/" if comparison.plots else f"{TABLE_CSV} in {out_dir}/")
