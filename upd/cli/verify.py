"""`upd verify RUN`: replay the optimizer's math against the recorded updates."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import click

from ..replay import ReplayRuleError, load_plugins
from ..replay.engine import EXIT_RULE_FAILED, verify as verify_run
from ..replay.registry import check_tolerances
from ..outputs import write_csv
from ..safe_text import LISTED_NAMES, shorten, shorten_all, terminal_safe_frame, text_table
from ..runfile.reader import frozen_params
from ..runfile.opening import open_run
from ..analyzer.report import VERIFY_COLUMNS_TEXT, VERIFY_HEADERS, verify_table
from .common import RUN_ARG, WIDE_OPTION, fail
from .progress import Progress


LINE_CHARS = 1000  # a problem or note line quoting the file (a name, a value) is bounded too


def report_text(report) -> str:
    """report.summary() with every string from the file in it (names, notes, problems) escaped for the terminal:
    escaped one by one, so that a name holding a newline cannot add a line of its own."""
    checks = terminal_safe_frame(report.checks)
    checks["param"] = checks["param"].map(shorten)
    checks["note"] = checks["note"].map(lambda n: shorten(n, LINE_CHARS))
    return dataclasses.replace(report, path=shorten(report.path, LINE_CHARS), checks=checks,
                               problems=[shorten(p, LINE_CHARS) for p in report.problems],
                               precision_notes=[shorten(n, LINE_CHARS) for n in report.precision_notes],
                               params_not_optimized=listed(report.params_not_optimized)).summary()


def listed(names: list) -> list[str]:
    """The first LISTED_NAMES names shortened, and how many more there are (--json has every one)."""
    more = [f"and {len(names) - LISTED_NAMES} more"] if len(names) > LISTED_NAMES else []
    return [shorten(n) for n in names[:LISTED_NAMES]] + more


@click.command(epilog="The table, one row per parameter: checked (its recorded steps replayed), mismatched, "
                      + VERIFY_COLUMNS_TEXT + " result: ok, FAIL, inconclusive or skipped (docs/verify.md).")
@RUN_ARG
@click.option("--rtol", type=float, default=None,
              help="Override each rule's tolerance relative to the largest update (see docs/verify.md).")
@click.option("--ulps", type=float, default=None, help="Override the per-element tolerance in storage ulps.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-parameter result as JSON.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write every check (one row per parameter and step) to this CSV file.")
@click.option("--rules", "rule_modules", multiple=True, metavar="MODULE",
              help="Import MODULE first (found from the current directory too, as with python -m): it registers "
                   "replay rules for your own optimizers with upd.replay.register (repeatable). Installed packages "
                   "can instead declare an entry point in the 'torch_upd.replay_rules' group, which is always "
                   "loaded.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes sharing the parameters and their steps: this one and N-1 workers (one core each).")
@WIDE_OPTION
def verify(run, rtol, ulps, as_json, csv_path, rule_modules, jobs, wide):
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
        fail(f"--{exc}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        # `python -m upd` puts the current directory first on sys.path; the console script does not. --rules
        # MODULE finds a module next to the user either way.
        sys.path.insert(0, os.getcwd())
    try:
        load_plugins(rule_modules)
    except Exception as exc:
        fail(f"could not load replay rules: {type(exc).__name__}: {exc}")
    try:
        with Progress("verifying") as bar:  # on stderr, and only on a terminal
            report = verify_run(run, rtol=rtol, ulps=ulps, jobs=jobs, rule_modules=rule_modules, progress=bar.update)
    except ReplayRuleError as exc:
        if os.environ.get("UPD_DEBUG"):
            raise
        fail(f"{exc} (set UPD_DEBUG=1 for the rule's traceback)", EXIT_RULE_FAILED)
    if csv_path:
        write_csv(report.checks, csv_path)  # spreadsheet-safe cells, never written through a planted link
    if as_json:
        by_param = report.by_param()
        click.echo(json.dumps({"path": report.path, "live": report.live, "exit_code": report.exit_code,
                               "matched": report.matched, "mismatched": report.mismatched,
                               "inconclusive": report.inconclusive,
                               "skipped": report.skipped,
                               "problems": report.problems, "precision_notes": report.precision_notes,
                               "params_not_optimized": report.params_not_optimized,
                               "mismatches": json.loads(report.checks[report.checks["status"] == "mismatch"]
                                                        .to_json(orient="records")),
                               "params": json.loads(by_param.to_json(orient="records"))}, indent=2))
    else:
        by_param = report.by_param()
        if len(by_param):
            shown = verify_table(by_param).drop(columns=["explanation"], errors="ignore")  # the MISMATCH lines say it
            click.echo(text_table(shown.rename(columns=VERIFY_HEADERS), wide=wide,
                                  keep=["optimizer", "param", "mismatched", "first mismatch", "result"],
                                  formats={h: (lambda v: f"{v:.2g}") for h in ("err/tol", "err/update")}))
        click.echo(report_text(report))
        for line in frozen_lines(run):
            click.echo(line)
    sys.exit(report.exit_code)


def frozen_lines(path) -> list[str]:
    """One line per optimizer that held parameters with requires_grad=False: they have nothing to verify."""
    with open_run(path) as r:
        return [f"frozen (requires_grad=False; no gradient, not verified): {shorten_all(frozen_params(opt))}"
                for opt in r.optimizers if frozen_params(opt)]
