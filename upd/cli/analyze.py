"""`upd analyze RUN`: ratios, the summary that flags unhealthy weights, plots and tables."""
from __future__ import annotations

import os

import click

from ..analyzer.analyze import analyze as analyze_run
from ..analyzer.summary import Thresholds, format_summary
from ..integrations.tensorboard import export_ratios
from ..runfile.reader import open_run
from .common import RUN_ARG, fail

def echo_analysis(result, thresholds: Thresholds) -> None:
    click.echo(format_summary(result.summary))
    flagged = result.flagged
    bounds = f"[{thresholds.low:g}, {thresholds.high:g}]"
    if len(flagged):
        click.echo(f"\n{len(flagged)} weight(s) outside {bounds} (healthy near {thresholds.target:g}): "
                   + ", ".join(f"{r.param} {r.status} ({r.median_update_to_data:.2f})" for r in flagged.itertuples()))
    else:
        click.echo(f"\nall weights within {bounds}")


@click.command()
@RUN_ARG
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the PNG plots and summary.csv (created if missing, never emptied). "
                   "Default: RUN's name without .h5, plus '-analysis'.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the full per-step ratio table (one row per parameter and step) to this CSV file.")
@click.option("--high", type=float, default=Thresholds.high, show_default=True,
              help="Flag a weight whose median update:data ratio (log10) is above this.")
@click.option("--low", type=float, default=Thresholds.low, show_default=True,
              help="Flag a weight whose median update:data ratio (log10) is below this.")
@click.option("--step", "hist_step", type=int, default=None,
              help="Optimizer step for the histograms (default: the last recorded step).")
@click.option("--all-params", is_flag=True, help="Plot biases and norm scales too, not only weights (ndim >= 2).")
@click.option("--no-plots", is_flag=True, help="Print the summary only; write no PNGs.")
@click.option("--tensorboard", "tb_dir", type=click.Path(file_okay=False), default=None,
              help="Also export the ratios and norms as TensorBoard scalars to this log dir "
                   "(needs the tensorboard extra).")
def analyze(run, out_dir, csv_path, high, low, hist_step, all_params, no_plots, tb_dir):
    """Compute update:data and grad:data ratios for every parameter and step of RUN.

    Prints one line per parameter: latest and median log10(std(update)/std(weight)) and log10(std(grad)/std(weight)),
    and a status for weights (ndim >= 2): ok near Karpathy's -3, HIGH above --high, LOW below --low. Writes
    update_to_data.png, grad_to_data.png, grad_histograms.png, weight_histograms.png and summary.csv to --out.
    """
    try:
        thresholds = Thresholds(high=high, low=low)
    except ValueError as exc:
        fail(str(exc))
    with open_run(run) as r:
        if r.live:
            click.echo(f"{run}: being written; analyzing the records committed so far\n")
        if out_dir is None and not no_plots:
            out_dir = os.path.splitext(run)[0] + "-analysis"
        result = analyze_run(r, None if no_plots else out_dir, thresholds=thresholds, hist_step=hist_step,
                             all_params=all_params)
    echo_analysis(result, thresholds)
    if csv_path:
        result.ratios.to_csv(csv_path, index=False)
        click.echo(f"ratios table: {csv_path}")
    if tb_dir:
        try:
            count = export_ratios(result.ratios, tb_dir)
        except ImportError as exc:
            fail(str(exc))
        click.echo(f"TensorBoard: {count} scalars in {tb_dir}/ (tensorboard --logdir {tb_dir})")
    if result.plots:
        click.echo(f"plots and summary.csv in {out_dir}/")
