"""`upd advise RUN`: per weight and per param group, the lr multiplier that brings update:data to a target."""
from __future__ import annotations

import json

import click

from ..analyzer.advise import DEFAULT_TARGET, advise as advise_run, format_advice, parse_steps
from ..runfile.opening import open_run
from .common import RUN_ARG, fail


@click.command()
@RUN_ARG
@click.option("--target", type=float, default=DEFAULT_TARGET, show_default=True,
              help="The update:data ratio (log10) to bring every weight's median to.")
@click.option("--steps", "steps_text", default=None, metavar="A:B",
              help="Measure over steps A to B (inclusive; either side may be empty). Default: every recorded step.")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON (tables, snippets, assumption).")
def advise(run, target, steps_text, as_json):
    """Advise a learning rate per weight and per param group from RUN's update:data ratios.

    For optimizers whose update is proportional to the lr (Adam family, sign-based, SGD with momentum, ...), the
    multiplier is 10 ** (target - measured median); for Adafactor's relative step, LBFGS and Rprop it says why
    none is derived. Prints a table, the per-group lines and param groups ready to paste into the optimizer.
    The advice holds over a short horizon (see docs/diagnosis.md)."""
    try:
        steps = parse_steps(steps_text)
    except ValueError as exc:
        fail(str(exc))
    if not -20 < target < 20:
        fail(f"--target {target}: a log10 ratio, e.g. -3")
    with open_run(run) as r:
        result = advise_run(r, target=target, steps=steps)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))  # JSON escapes control characters itself
        return
    if result.steps is not None and result.per_param.empty:  # every parameter a vector: no table to show
        click.echo("no weight (ndim >= 2) in the run: nothing to advise (biases and norm scales are not judged)")
        return
    click.echo(format_advice(result))
