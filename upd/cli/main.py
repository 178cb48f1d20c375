"""The `upd` command: a thin shell over the Python API (upd.open_run, upd.analyze, upd.verify).

Each command lives in its own module of this package; this one builds the group and registers them."""
from __future__ import annotations

import importlib
import signal

import click

from .. import __version__
from .common import EXIT_CODES, ErrorLineGroup

# Each command's module, imported when the command runs (or --help lists it): `upd info` then imports neither the
# replay engine nor the recorder, nor torch with them.
COMMANDS = {"info": ".info", "analyze": ".analyze", "verify": ".verify", "demo": ".demo", "record": ".record",
            "compare": ".compare", "advise": ".advise"}


# What `upd --help` lists for each command (click would cut each docstring's first sentence at 45 characters).
SUMMARIES = {"info": "what a run file (or a distributed job) holds",
             "analyze": "update:data and grad:data ratios: table, plots, HTML report",
             "compare": "two or more runs side by side, weight by weight",
             "verify": "replay the optimizer's math against the recorded updates",
             "advise": "per-layer learning-rate advice from the update:data ratios",
             "demo": "train a small model, record it, analyze it, verify it",
             "record": "record a training program without editing it: RUN -- COMMAND"}


class _CommandsWhenUsed(ErrorLineGroup):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        command = getattr(importlib.import_module(COMMANDS[name], __package__), name)
        command.short_help = command.short_help or SUMMARIES.get(name)
        return command


@click.group(cls=_CommandsWhenUsed, epilog=EXIT_CODES, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="upd")
def main():
    """torch-upd: see what your PyTorch optimizer does.

    Record a run inside training with `upd.record(path, model, optimizer)`, then inspect it here:

    \b
      upd info RUN       what the run file holds
      upd analyze RUN    update:data and grad:data ratios, summary, plots
      upd compare A B    runs side by side per weight (good vs bad init, lr A vs lr B)
      upd verify RUN     replay the optimizer's math against the recorded updates
      upd advise RUN     per-layer learning-rate advice from the update:data ratios
      upd demo           train a small character-level model, record, analyze, verify
      upd record RUN     record a training program without editing it: upd record RUN -- COMMAND

    RUN may still be being written: the commands then read a copy taken between two records, holding every
    record committed so far (see docs/format.md, "Live reading"). RUN may also be the path a distributed job was
    recorded to: the commands then read every rank's file as one job (docs/distributed.md).
    """


def run() -> None:
    """Console entry point."""
    # `upd verify RUN | head` should end quietly like any Unix tool, not with a BrokenPipeError.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()


if __name__ == "__main__":
    run()
