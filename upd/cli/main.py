"""The `upd` command: a thin shell over the Python API (upd.open_run, upd.analyze, upd.verify)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import datetime, timezone

import click

from .. import __version__
from ..analyzer.analyze import analyze as analyze_run
from ..analyzer.summary import Thresholds, format_summary
from ..demo import makemore
from ..integrations.tensorboard import export_ratios
from ..replay import ReplayRuleError, load_plugins
from ..replay.engine import EXIT_RULE_FAILED, EXIT_UNUSABLE, verify as verify_run
from ..replay.registry import check_tolerances
from ..runfile import schema
from ..runfile.reader import RunFileError, open_run

EXIT_CODES = """\b
Exit codes:
  0  success (verify: every checked step matched)
  1  verify: at least one recorded update differs from the replay
  2  unusable input: missing or unreadable file, not a torch-upd run, bad option
  3  verify: nothing verifiable (no replay rule for the optimizer, or what the
     replay needs was not recorded)
  4  verify: a replay rule failed (raised an error: a bug in the rule, named
     with the step and parameter, not in the run file)
"""


def _fail(message: str, code: int = EXIT_UNUSABLE) -> None:
    click.echo(f"upd: error: {message}", err=True)
    sys.exit(code)


class _Group(click.Group):
    def invoke(self, ctx):
        # One clear line and exit 2 for a bad file, never a traceback; UPD_DEBUG=1 shows tracebacks of real bugs.
        try:
            return super().invoke(ctx)
        except RunFileError as exc:
            _fail(str(exc))
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            if os.environ.get("UPD_DEBUG"):
                raise
            _fail(f"{type(exc).__name__}: {exc} (set UPD_DEBUG=1 for a traceback)")


# readable=False: the reader reports an unreadable file in its own one line (click would print a usage error).
RUN_ARG = click.argument("run", type=click.Path(dir_okay=True, readable=False, path_type=str))


@click.group(cls=_Group, epilog=EXIT_CODES, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="upd")
def main():
    """torch-upd: see what your PyTorch optimizer does.

    Record a run inside training with `upd.record(path, model, optimizer)`, then inspect it here:

    \b
      upd info RUN       what the run file holds
      upd analyze RUN    update:data and grad:data ratios, summary, plots
      upd verify RUN     replay the optimizer's math against the recorded updates
      upd demo           train a small character-level model, record, analyze, verify

    RUN may still be being written: the commands then read a copy taken between two records, holding every
    record committed so far (see docs/format.md, "Live reading"). RUN may also be the path a distributed job was
    recorded to: the commands then read every rank's file as one job (docs/distributed.md).
    """


@main.command()
@RUN_ARG
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def info(run, as_json):
    """Show what RUN holds: optimizers, param groups, parameters with shapes, steps, size.

    For a distributed job's path: its world size, what each rank's file holds (and which steps it lacks), and how
    each parameter is spread over the ranks (sharded, a partition, replicated)."""
    with open_run(run) as r:
        desc = r.describe()
    if as_json:
        click.echo(json.dumps(desc, indent=2))
        return
    created = desc["created_unix"]
    when = datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if created else "?"
    job = desc.get("job")
    kind = "torch-upd run" if job is None else \
        f"torch-upd job of {job['world_size']} processes ({job['parallelism'] or '?'}), {len(job['ranks'])} rank files"
    click.echo(f"{desc['path']}: {kind}, format v{desc['format_version']}, {desc['size_bytes'] / 1e6:.2f} MB"
               + (", being written (this shows the records committed so far)" if desc["live"] else ""))
    rank_of = desc.get(schema.META_DISTRIBUTED)
    if rank_of:
        click.echo(f"  rank {rank_of.get('rank')} of a job of {rank_of.get('world_size')} processes "
                   f"({rank_of.get('parallelism')}): this file holds that rank's part; the whole job: "
                   f"upd info {rank_of.get('job_path')}")
    click.echo(f"  recorded {when} with torch {desc['torch_version']}, upd {desc['upd_version']}")
    opts = desc["options"]
    click.echo(f"  options: every={opts.get('every')} stats_every={opts.get('stats_every')} what={','.join(opts.get('what', []))} "
               f"dtype={opts.get('dtype')} compression={opts.get('compression')}"
               + (f" include={opts['include']}" if opts.get("include") else "")
               + (f" exclude={opts['exclude']}" if opts.get("exclude") else ""))
    for rank in job["ranks"] if job else []:
        held = ", ".join(f"optimizer {o['index']}: {o['records']} full-tensor records, {o['stats_steps']} statistics "
                         f"steps" for o in rank["optimizers"])
        lacks = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in rank["lacks_steps"])
        click.echo(f"  rank {rank['rank']}: {os.path.basename(rank['path'])}, {rank['size_bytes'] / 1e6:.2f} MB, {held}"
                   + (f"; lacks steps {lacks} (the job reads the steps every rank holds)" if lacks else ""))
    for opt in desc["optimizers"]:
        span = f"steps {opt['first_step']}..{opt['last_step']}" if opt["records"] else "no steps"
        click.echo(f"optimizer {opt['index']}: {opt['class']}, {opt['param_groups']} param group(s), "
                   f"{opt['records']} full-tensor records ({span}), {opt['stats_steps']} statistics steps")
        width = max([len(p["name"]) for p in opt["params"]] + [5])
        for p in opt["params"]:
            shape = "x".join(map(str, p["shape"])) or "scalar"
            where = f"  {p['layout']} on ranks {','.join(map(str, p['ranks']))}" if "layout" in p else ""
            click.echo(f"  {p['name']:<{width}}  {shape:>12}  {p['dtype'] or '?':>8}  group {p['group']}  "
                       f"{p['rows']:>5} rows  state: {','.join(p['state']) or '-'}{where}")
    if desc["params_not_optimized"]:
        click.echo(f"model parameters in no optimizer: {', '.join(desc['params_not_optimized'])}")


def _echo_analysis(result, thresholds: Thresholds) -> None:
    click.echo(format_summary(result.summary))
    flagged = result.flagged
    bounds = f"[{thresholds.low:g}, {thresholds.high:g}]"
    if len(flagged):
        click.echo(f"\n{len(flagged)} weight(s) outside {bounds} (healthy near {thresholds.target:g}): "
                   + ", ".join(f"{r.param} {r.status} ({r.median_update_to_data:.2f})" for r in flagged.itertuples()))
    else:
        click.echo(f"\nall weights within {bounds}")


@main.command()
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
        _fail(str(exc))
    with open_run(run) as r:
        if r.live:
            click.echo(f"{run}: being written; analyzing the records committed so far\n")
        if out_dir is None and not no_plots:
            out_dir = os.path.splitext(run)[0] + "-analysis"
        result = analyze_run(r, None if no_plots else out_dir, thresholds=thresholds, hist_step=hist_step,
                             all_params=all_params)
    _echo_analysis(result, thresholds)
    if csv_path:
        result.ratios.to_csv(csv_path, index=False)
        click.echo(f"ratios table: {csv_path}")
    if tb_dir:
        try:
            count = export_ratios(result.ratios, tb_dir)
        except ImportError as exc:
            _fail(str(exc))
        click.echo(f"TensorBoard: {count} scalars in {tb_dir}/ (tensorboard --logdir {tb_dir})")
    if result.plots:
        click.echo(f"plots and summary.csv in {out_dir}/")


@main.command()
@RUN_ARG
@click.option("--rtol", type=float, default=None,
              help="Override each rule's tolerance relative to the largest update (see docs/verify.md).")
@click.option("--ulps", type=float, default=None, help="Override the per-element tolerance in storage ulps.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-parameter result as JSON.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write every check (one row per parameter and step) to this CSV file.")
@click.option("--rules", "rule_modules", multiple=True, metavar="MODULE",
              help="Import MODULE first: it registers replay rules for your own optimizers with "
                   "upd.replay.register (repeatable). Installed packages can instead declare an entry point in "
                   "the 'torch_upd.replay_rules' group, which is always loaded.")
def verify(run, rtol, ulps, as_json, csv_path, rule_modules):
    """Replay the optimizer's math for every recorded step of RUN and compare with the recorded update.

    Each step is recomputed in float64 from the recorded parameter, gradient, optimizer state and param-group
    hyperparameters, and compared with the recorded parameter after the step (and with the optimizer state at the
    next step, when that was recorded). A mismatch means the optimizer did not do what its hyperparameters say:
    clipping or scaling after the recorder's hook, a different lr, missing or doubled weight decay, or a parameter
    changed outside the optimizer. Each mismatch is explained when replaying an alternative (a scaled gradient,
    another lr, weight decay dropped or doubled) reproduces the record.

    RUN may be the path a distributed job was recorded to (rank files named like runs/x.rank0-of-4.h5 for
    runs/x.h5): each rank's file is replayed on its own (FSDP2 shards shard by shard), every mismatch names its
    rank, and replicas recorded with ranks="all" are compared with rank 0's (docs/distributed.md).
    """
    try:
        check_tolerances(rtol, ulps)
    except ValueError as exc:
        _fail(f"--{exc}")
    try:
        load_plugins(rule_modules)
    except Exception as exc:
        _fail(f"could not load replay rules: {type(exc).__name__}: {exc}")
    try:
        report = verify_run(run, rtol=rtol, ulps=ulps)
    except ReplayRuleError as exc:
        if os.environ.get("UPD_DEBUG"):
            raise
        _fail(f"{exc} (set UPD_DEBUG=1 for the rule's traceback)", EXIT_RULE_FAILED)
    if csv_path:
        report.checks.to_csv(csv_path, index=False)
    if as_json:
        by_param = report.by_param()
        click.echo(json.dumps({"path": report.path, "live": report.live, "exit_code": report.exit_code, "matched": report.matched,
                               "mismatched": report.mismatched, "skipped": report.skipped,
                               "problems": report.problems, "precision_notes": report.precision_notes,
                               "params_not_optimized": report.params_not_optimized,
                               "mismatches": json.loads(report.checks[report.checks["status"] == "mismatch"]
                                                        .to_json(orient="records")),
                               "params": json.loads(by_param.to_json(orient="records"))}, indent=2))
    else:
        by_param = report.by_param()
        if len(by_param):
            cols = ["param", "checked", "mismatched", "err_to_tol", "update_rel_err", "first_mismatch_step", "result"]
            if "first_mismatch_rank" in by_param:  # a distributed job
                cols.insert(cols.index("first_mismatch_step") + 1, "first_mismatch_rank")
            if report.checks["optimizer"].nunique() > 1:
                cols.insert(0, "optimizer")
            shown = by_param[cols].astype(object).where(by_param[cols].notna(), "-")
            click.echo(shown.to_string(index=False, formatters={
                c: (lambda v: v if isinstance(v, str) else f"{v:.2g}") for c in ("err_to_tol", "update_rel_err")}))
        click.echo(report.summary())
    sys.exit(report.exit_code)


@main.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="upd-demo", show_default=True,
              help="Folder for the run file, plots and tables.")
@click.option("--init", type=click.Choice(["good", "bad"]), default="good", show_default=True,
              help="'bad' uses a poor initialization, to show what unhealthy ratios look like.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Training steps (default: the demo's).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing demo run in --out.")
def demo(out_dir, init, steps, seed, force):
    """Train a makemore-style character model on a shipped corpus of names, record it, analyze it, verify it.

    The network is Karpathy's from "makemore part 3": an embedding, a stack of Linear -> BatchNorm1d -> Tanh
    layers and an output Linear, trained with SGD. Takes well under a minute on 2 CPU cores.
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"demo-{init}.h5")
    if os.path.exists(path) and not force:
        _fail(f"{path} exists; pass --force to replace it or choose another --out")
    started = time.perf_counter()
    kwargs = {"init": init, "seed": seed}
    if steps is not None:
        kwargs["steps"] = steps
    makemore.train(path, log=lambda msg: click.echo(f"  {msg}"), **kwargs)
    click.echo(f"recorded {path} ({os.path.getsize(path) / 1e6:.1f} MB) in {time.perf_counter() - started:.1f} s")
    analysis_dir = os.path.join(out_dir, f"analysis-{init}")
    analysis = analyze_run(path, analysis_dir)
    _echo_analysis(analysis, Thresholds())
    csv_path = os.path.join(analysis_dir, "ratios.csv")
    analysis.ratios.to_csv(csv_path, index=False)
    report = verify_run(path)
    click.echo(report.summary())
    click.echo(f"\nplots: {', '.join(analysis.plots)}")
    click.echo(f"tables: {os.path.join(analysis_dir, 'summary.csv')}, {csv_path}")
    click.echo(f"done in {time.perf_counter() - started:.1f} s. Next: upd analyze {path}   upd verify {path}")
    if report.exit_code != 0:
        sys.exit(report.exit_code)


def run() -> None:
    """Console entry point."""
    # `upd verify RUN | head` should end quietly like any Unix tool, not with a BrokenPipeError.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()


if __name__ == "__main__":
    run()
