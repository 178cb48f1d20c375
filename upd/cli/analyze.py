"""`upd analyze RUN`: ratios, the summary that flags unhealthy weights, plots, tables and a shareable report.

Every option is checked, and every output folder created, before the run is read: a typo must not cost a long
analysis first."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import textwrap

import click

from ..analyzer.analyze import SUMMARY_CSV, analyze as analyze_run
from ..analyzer.clipping import clipping_lines
from ..analyzer.report import param_groups_of, verdict, write_report
from ..analyzer.summary import Thresholds, format_summary
from ..integrations.tensorboard import INSTALL_HINT, export_tables
from ..replay import ReplayRuleError
from ..replay.engine import verify as verify_run
from ..runfile.reader import frozen_params
from ..runfile.opening import open_run
from ..sinks.export import export_to_tracker, tracker_problem
from ..outputs import derived_folder, input_files, refuse_inputs, write_csv
from ..safe_text import TABLE_WIDTH, shorten, shorten_all, terminal_safe
from .common import RUN_ARG, WIDE_OPTION, fail
from .progress import Progress
from .verify import report_text


FINDING_CHARS = 600  # a finding longer than this (a file's 1 MB name in it) is shortened in the middle


def wrapped(text: str, width: int = TABLE_WIDTH) -> str:
    """Each line of text wrapped to `width` columns, continuation lines indented under the line's own text."""
    lines = []
    for line in text.splitlines():
        indent = " " * (len(line) - len(line.lstrip()) + 3)
        lines += textwrap.wrap(line, width, subsequent_indent=indent) or [""]
    return "\n".join(lines)


def echo_analysis(result, thresholds: Thresholds, wide: bool = False) -> None:
    # Findings first; names are the file's text: escaped, bounded, and wrapped to the tables' width.
    click.echo(wrapped(result.findings_text(lambda text: shorten(text, FINDING_CHARS))) + "\n")
    click.echo(format_summary(result.summary, wide=wide))  # names: the file's text, shown escaped and bounded
    shown = result.summary.assign(param=result.summary["param"].map(shorten))
    click.echo("\n" + verdict(dataclasses.replace(result, summary=shown), thresholds))
    for note in result.notes:
        click.echo(terminal_safe(note))


def frozen_lines(run) -> list[str]:
    return [f"frozen (requires_grad=False; no gradient, not analyzed): {shorten_all(frozen_params(opt))}"
            for opt in run.optimizers if frozen_params(opt)]


def tensorboard_problem() -> str | None:
    """Why TensorBoard output cannot be written here (the package is missing), or None."""
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError as exc:
        return f"--tensorboard needs the tensorboard package ({exc}): {INSTALL_HINT}"
    return None


def make_parent(path: str, option: str) -> None:
    """Create the folder an output file goes into, as --out creates its folder; one error line if impossible."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        fail(f"{option} {path}: cannot create the folder {folder} ({exc.strerror or exc})")
    if os.path.isdir(path):
        fail(f"{option} {path}: is a folder; give a file name")


def make_folder(path: str, option: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{option} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        fail(f"{option} {path}: cannot create the folder ({exc.strerror or exc})")


class OneRunCommand(click.Command):
    """analyze reads one run: a second RUN is someone looking for `upd compare` (one line saying so, exit 2)."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if "unexpected extra argument" not in exc.format_message():
                raise
            raise click.UsageError("analyze reads one run; to compare runs side by side: upd compare RUN RUN...",
                                   ctx) from None


@click.command(cls=OneRunCommand)
@RUN_ARG
@click.option("--out", "out_dir", type=click.Path(), default=None, metavar="DIR",  # make_folder says what is wrong in one line
              help="Folder for the PNG plots and summary.csv (created if missing, never emptied). "
                   "Default: RUN's name without .h5, plus '-analysis'. With --no-plots, summary.csv alone, and only "
                   "when --out is given.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the full per-step ratio table (one row per parameter and step) to this CSV file "
                   "(its folder is created if missing).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Also write one self-contained HTML report to this file: the figures, the summary table, the "
                   "run's metadata (and the verify result with --verify). Opens in any browser, no server needed.")
@click.option("--verify", "with_verify", is_flag=True,
              help="Also replay the optimizer's math as `upd verify` does, print its summary and put its result in "
                   "the --html report. The exit code stays analyze's.")
@click.option("--high", type=float, default=Thresholds.high, show_default=True,
              help="Flag a weight whose median update:data ratio (log10) is above this.")
@click.option("--low", type=float, default=Thresholds.low, show_default=True,
              help="Flag a weight whose median update:data ratio (log10) is below this.")
@click.option("--step", "hist_step", type=int, default=None,
              help="Draw the histograms at this optimizer step alone (it needs a full-tensor record). Default: the "
                   "first, middle and last full records, compared.")
@click.option("--all-params", is_flag=True, help="Plot biases and norm scales too, not only weights (ndim >= 2).")
@click.option("--no-plots", is_flag=True, help="Draw no figures: print the summary (and write the tables asked for).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the whole analysis as JSON (findings, summary, per-step metrics, notes) instead of text.")
@click.option("--metric", type=click.Choice(["std", "rms", "spectral"]), default="std", show_default=True,
              help="The ratio update_to_data.png draws: std (log10 std(update)/std(weight)), rms (relative "
                   "Frobenius norm) or spectral (spectral-norm ratio, full-tensor records only).")
@click.option("--tensorboard", "tb_dir", type=click.Path(file_okay=False), default=None,
              help="Also export the ratios and norms as TensorBoard scalars to this log dir "
                   "(needs the tensorboard extra).")
@click.option("--wandb", "to_wandb", is_flag=True,
              help="Also export the ratios, norms and logged scalars to a new W&B run (WANDB_PROJECT, WANDB_MODE "
                   "and the other WANDB_* variables apply; needs the wandb extra).")
@click.option("--mlflow", "to_mlflow", is_flag=True,
              help="Also export them to a new MLflow run (MLFLOW_TRACKING_URI, else ./mlflow.db; "
                   "MLFLOW_EXPERIMENT_NAME; needs the mlflow extra).")
@WIDE_OPTION
def analyze(run, out_dir, csv_path, html_path, with_verify, high, low, hist_step, all_params, no_plots, as_json,
            metric, tb_dir, to_wandb, to_mlflow, wide):
    """Compute update:data and grad:data ratios for every parameter and step of RUN.

    Prints one line per parameter, in model order: log10(std(update)/std(weight)) and log10(std(grad)/std(weight))
    at the last recorded step and their medians over all records, and a status for weights (ndim >= 2): ok near
    Karpathy's -3, HIGH above --high, LOW below --low. Writes update_to_data.png and grad_to_data.png (a line per
    weight, or a heatmap for more than ten, with the learning rate and the logged loss below),
    grad_histograms.png, weight_histograms.png and summary.csv to --out. To compare runs: upd compare A B.
    """
    try:
        thresholds = Thresholds(high=high, low=low)
    except ValueError as exc:
        fail(str(exc))
    if tb_dir and (problem := tensorboard_problem()):
        fail(problem)
    trackers = [name for name, wanted in (("wandb", to_wandb), ("mlflow", to_mlflow)) if wanted]
    for problem in filter(None, map(tracker_problem, trackers)):
        fail(problem)
    for path, option in ((csv_path, "--csv"), (html_path, "--html")):
        if path:
            make_parent(path, option)
    if out_dir is None and not no_plots:
        out_dir = derived_folder(run, "-analysis")
    refuse_inputs([csv_path, html_path, out_dir and os.path.join(out_dir, SUMMARY_CSV)], input_files([run]))
    with open_run(run) as r:
        if out_dir is not None:
            make_folder(out_dir, "--out")
        if r.live:
            click.echo(f"{run}: being written; analyzing the records committed so far\n")
        with Progress("analyzing") as bar:  # on stderr, and only on a terminal
            try:
                result = analyze_run(r, out_dir, thresholds=thresholds, hist_step=hist_step, all_params=all_params,
                                     plots=not no_plots, metric=metric, progress=bar.stage)
            except ValueError as exc:  # a --step without a full record: checked before the ratios are computed
                fail(f"--step: {exc}")
            notes = clipping_lines(r) + frozen_lines(r)
            scalars = r.scalars()
            report = None
            if with_verify:
                try:
                    report = verify_run(r, progress=lambda done, total: bar.update(done, total, "verifying"))
                except ReplayRuleError as exc:
                    notes.append(f"verify could not run: {exc}")
        description = r.describe() if html_path else None
        groups = param_groups_of(r) if html_path else None
    if as_json:
        data = result.to_dict() | {"notes": result.notes + notes}
        if report is not None:
            data["verify"] = report.summary()
        click.echo(json.dumps(data, indent=2))  # JSON escapes control characters itself
    else:
        echo_analysis(result, thresholds, wide)
        for note in notes:
            click.echo(terminal_safe(note))
    say = functools.partial(click.echo, err=as_json)  # with --json, stdout holds the JSON alone
    if report is not None:
        say("\nverify: " + report_text(report))
    if csv_path:
        write_csv(result.ratios, csv_path)  # spreadsheet-safe cells, never written through a planted link
        say(f"ratios table: {csv_path}")
    if tb_dir:
        count = export_tables(result.ratios, scalars, tb_dir)
        say(f"TensorBoard: {count} scalars in {tb_dir}/ (tensorboard --logdir {tb_dir})")
    for tracker in trackers:
        try:
            say(terminal_safe(export_to_tracker(tracker, result.ratios, scalars, os.path.basename(run))))
        except Exception as exc:  # the tracker's own refusal (no login, a server that does not answer): one line
            fail(f"--{tracker}: the export failed ({type(exc).__name__}: {exc})")
    if html_path:
        write_report(html_path, result, description, thresholds=thresholds, notes=notes, verify_report=report,
                     groups=groups)
        say(f"report: {html_path}")
    if out_dir is not None:
        say(f"plots and {SUMMARY_CSV} in {out_dir}/" if result.plots else f"{SUMMARY_CSV} in {out_dir}/")
