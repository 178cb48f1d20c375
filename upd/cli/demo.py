"""`upd demo`: train a small model, record it, analyze it, verify it."""
from __future__ import annotations

import os
import shlex
import sys
import time

import click

from ..analyzer.analyze import analyze as analyze_run
from ..analyzer.summary import Thresholds
from ..demo import makemore
from ..replay.engine import verify as verify_run
from .analyze import echo_analysis
from .common import fail
from .progress import Progress

DEFAULT_OUT = "upd-demo"


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=DEFAULT_OUT, show_default=True,
              help="Folder for the run file, plots and tables.")
@click.option("--init", type=click.Choice(["good", "bad"]), default="good", show_default=True,
              help="'bad' uses a poor initialization, to show what unhealthy ratios look like.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help=f"Training steps (default: {makemore.DEFAULT_STEPS}).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the initialization and the order of the training examples: the same seed, the same run.")
@click.option("--force", is_flag=True, help="Replace an existing demo run in --out.")
def demo(out_dir, init, steps, seed, force):
    """Train a makemore-style character model on a shipped corpus of names, record it, analyze it, verify it.

    The network is Karpathy's from "makemore part 3": an embedding, a stack of Linear -> BatchNorm1d -> Tanh
    layers and an output Linear, trained with SGD. Takes well under a minute on 2 CPU cores.

    Writes into --out: demo-good.h5 (or demo-bad.h5 with --init bad; every step's full tensors, 39 MB for the
    default steps) and analysis-good/ (the plots, summary.csv and ratios.csv). Then try --init bad and
    `upd compare` of the two runs.
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"demo-{init}.h5")
    if os.path.exists(path) and not force:
        fail(f"{path} exists; pass --force to replace it or choose another --out")
    started = time.perf_counter()
    kwargs = {"init": init, "seed": seed}
    if steps is not None:
        kwargs["steps"] = steps
    with Progress("training") as bar:  # on stderr, and only on a terminal
        makemore.train(path, log=lambda msg: bar.echo(f"  {msg}"),
                       progress=lambda done, total: bar.update(done, total), **kwargs)
    click.echo(f"recorded {path} ({os.path.getsize(path) / 1e6:.1f} MB) in {time.perf_counter() - started:.1f} s")
    analysis_dir = os.path.join(out_dir, f"analysis-{init}")
    with Progress("analyzing") as bar:
        analysis = analyze_run(path, analysis_dir, progress=bar.stage)
    echo_analysis(analysis, Thresholds())
    csv_path = os.path.join(analysis_dir, "ratios.csv")
    analysis.ratios.to_csv(csv_path, index=False)
    with Progress("verifying") as bar:
        report = verify_run(path, progress=bar.update)
    click.echo(report.summary())
    click.echo(f"\nplots: {', '.join(analysis.plots)}")
    click.echo(f"tables: {os.path.join(analysis_dir, 'summary.csv')}, {csv_path}")
    click.echo(f"done in {time.perf_counter() - started:.1f} s. Next:")
    for line in next_steps(out_dir, init, path, analysis_dir):
        click.echo(f"  {line}")
    if report.exit_code != 0:
        sys.exit(report.exit_code)


def next_steps(out_dir: str, init: str, path: str, analysis_dir: str) -> list[str]:
    """What to try after this demo run: nothing that writes the analysis just written a second time."""
    q = shlex.quote  # paths as a shell reads them back
    other = os.path.join(out_dir, f"demo-{'bad' if init == 'good' else 'good'}.h5")
    out = "" if out_dir == DEFAULT_OUT else f" --out {q(out_dir)}"
    if os.path.exists(other):
        good, bad = (path, other) if init == "good" else (other, path)
        lines = [f"upd compare {q(good)} {q(bad)} --out {q(os.path.join(out_dir, 'compare'))}   the two runs side "
                 "by side, per weight"]
    elif init == "good":
        lines = [f"upd demo --init bad{out}   the same model badly initialized, beside this run (then upd compare "
                 "the two)"]
    else:
        lines = [f"upd demo{out}   the well initialized run, beside this one (then upd compare the two)"]
    return lines + [f"upd analyze {q(path)} --out {q(analysis_dir)} --html "
                    f"{q(os.path.join(analysis_dir, 'report.html'))} --verify   this analysis as one HTML page to share"]