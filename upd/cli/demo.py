"""`upd demo`: train a small model, record it, analyze it, verify it."""
from __future__ import annotations

import os
import sys
import time

import click

from ..analyzer.analyze import analyze as analyze_run
from ..analyzer.summary import Thresholds
from ..demo import makemore
from ..replay.engine import verify as verify_run
from .analyze import echo_analysis
from .common import fail

@click.command()
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
        fail(f"{path} exists; pass --force to replace it or choose another --out")
    started = time.perf_counter()
    kwargs = {"init": init, "seed": seed}
    if steps is not None:
        kwargs["steps"] = steps
    makemore.train(path, log=lambda msg: click.echo(f"  {msg}"), **kwargs)
    click.echo(f"recorded {path} ({os.path.getsize(path) / 1e6:.1f} MB) in {time.perf_counter() - started:.1f} s")
    analysis_dir = os.path.join(out_dir, f"analysis-{init}")
    analysis = analyze_run(path, analysis_dir)
    echo_analysis(analysis, Thresholds())
    csv_path = os.path.join(analysis_dir, "ratios.csv")
    analysis.ratios.to_csv(csv_path, index=False)
    report = verify_run(path)
    click.echo(report.summary())
    click.echo(f"\nplots: {', '.join(analysis.plots)}")
    click.echo(f"tables: {os.path.join(analysis_dir, 'summary.csv')}, {csv_path}")
    click.echo(f"done in {time.perf_counter() - started:.1f} s. Next: upd analyze {path}   upd verify {path}")
    if report.exit_code != 0:
        sys.exit(report.exit_code)
