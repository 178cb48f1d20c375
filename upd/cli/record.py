"""`upd record RUN [OPTIONS] -- COMMAND [ARGS]...`: record a training program without editing it (upd.launcher)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import click

from ..launcher import env
from ..recorder import options
from ..recorder.cadence import AUTO
from ..recorder.options import check_record_options
from ..runfile import schema
from .common import fail

# Where parse_args leaves the command found after `--` for the callback.
_COMMAND = "upd.record.command"

EXIT_CODES = """\b
Exit codes:
  the command's own   the command ran: its exit status, unchanged (a command
                      ended by a signal ends the same way)
  2                   bad option, no command, or RUN already holds a run
                      (without --overwrite or --resume); nothing was started
  126                 the command could not be executed
  127                 the command was not found
"""


class _Never(click.ParamType):
    """A positive number of steps, or 'never' (None); with `auto`, also 'auto' (every='s default)."""

    def __init__(self, auto: bool = False):
        self.auto = auto
        self.name = "N|never|auto" if auto else "N|never"

    def convert(self, value, param, ctx):
        if value is None or value == "never":
            return None
        if self.auto and value == AUTO:
            return AUTO
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a positive number of steps nor 'never'", param, ctx)
        if number < 1:
            self.fail(f"{value!r} is not a positive number of steps", param, ctx)
        return number


class _Ranks(click.ParamType):
    """'auto' (None), 'all', or one rank number."""

    name = "auto|all|RANK"

    def convert(self, value, param, ctx):
        if value in (None, "auto"):
            return None
        if value == schema.ALL_RANKS:
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
        self.fail(f"{value!r} is not 'auto', 'all' or a rank number", param, ctx)


class _RecordCommand(click.Command):
    """Everything after the first `--` is the command, untouched by option parsing (its own --help, --lr ...); a
    bad option is one line and exit 2, never click's usage block."""

    def parse_args(self, ctx, args):
        args = list(args)
        separated = "--" in args
        if separated:
            at = args.index("--")
            args, ctx.meta[_COMMAND] = args[:at], args[at + 1:]
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            hint = "" if separated else " (the command goes after --: upd record RUN [OPTIONS] -- COMMAND [ARGS]...)"
            fail(exc.format_message().rstrip(".") + hint)

    def collect_usage_pieces(self, ctx):
        return ["RUN", "[OPTIONS]", "--", "COMMAND", "[ARGS]..."]


def _flag(field) -> click.Option:
    """The launcher's flag for one of upd.record's options (upd.recorder.options): its kind says what it takes."""
    meta = field.metadata
    name, flag, kind = field.name, "--" + field.name.replace("_", "-"), field.metadata["kind"]
    common = dict(help=meta["help"], metavar=meta["metavar"] or None)
    if kind == options.STEPS_OR_NEVER:
        return click.Option([flag], type=_Never(auto=field.default == AUTO),
                            default="never" if field.default is None else str(field.default),
                            show_default="(default:" not in meta["help"], **common)  # or the help says it
    if kind == options.COUNT:
        return click.Option([flag], type=int, default=None, **common)  # checked by upd.record's own checks
    if kind == options.FACTOR:
        return click.Option([flag], type=float, default=field.default, show_default=True, **common)
    if kind == options.GLOBS:
        return click.Option([flag], multiple=True, **common)
    if kind == options.CHOICES:
        return click.Option([flag], multiple=True, type=click.Choice(meta["choices"]), **common)
    if kind == options.CHOICE:
        return click.Option([flag], type=click.Choice(meta["choices"]), default=field.default,
                            show_default=field.default is not None, **common)
    if kind == options.LOG_DIR:
        return click.Option([flag], type=click.Path(file_okay=False, path_type=str), default=None, **common)
    if kind == options.RANKS:
        return click.Option([flag], type=_Ranks(), default="auto", show_default=True, **common)
    if kind == options.FLAG:
        return click.Option([flag], is_flag=True, **common)
    raise AssertionError(f"option {name}: no flag for a value of kind {kind!r}")


# One flag per option upd.record takes from a command line, in the options' order.
FLAGS = [field for field in options.fields() if field.metadata["kind"] != options.PYTHON_ONLY]


def _with_flags(command):
    for field in reversed(FLAGS):
        command.params.insert(1, _flag(field))  # after RUN
    return command


@_with_flags
@click.command(cls=_RecordCommand, epilog=EXIT_CODES)
@click.argument("run", type=click.Path(dir_okay=False, path_type=str))
@click.pass_context
def record(ctx, run, **given):
    """Record every torch.optim optimizer that COMMAND creates into RUN, without editing COMMAND.

    \b
    EXAMPLES
      upd record runs/lm.h5 --every 50 --stats-every 1 -- python main.py --lr 1e-3
      upd record runs/lm.h5 --ranks all -- torchrun --nproc_per_node 4 train.py
      upd analyze runs/lm.h5; upd verify runs/lm.h5

    \b
    DESCRIPTION
    The options are upd.record's (README.md, "Recording"); everything after `--`
    is the command, run as it is. `upd record` checks the options, then replaces
    itself with the command (exec): the command's arguments, environment,
    working directory, standard streams and exit status are its own, and signals
    (Ctrl-C, SIGTERM) reach it directly. Each recording process closes its run
    cleanly on SIGTERM, Ctrl-C and exit.

    \b
    WHAT IS RECORDED
    At an optimizer's first step, that optimizer and every other one the process
    created and has not stepped yet go into one run, named as
    model.named_parameters() names them for the module that owns the parameters
    (found among the live modules; no `module.` or `_orig_mod.` prefix).
    Optimizers created later (a new phase, a replaced optimizer) and processes
    that train on their own go into further parts: RUN.part2.h5 for RUN.h5, and
    so on. A process that never steps an optimizer writes nothing.

    \b
    DISTRIBUTED JOBS
    torchrun's and torch.multiprocessing's workers are reached too, and record
    by upd.record's rules (docs/distributed.md): DDP and other replicated
    training on rank 0 into RUN, FSDP2 and ZeRO (or --ranks all) on every rank
    into RUN.rankR-of-W.h5. Every `upd` command given RUN reads the whole job.

    \b
    ENVIRONMENT
    The command runs with UPD_RECORD (the options, as JSON) set and a bootstrap
    directory first on PYTHONPATH. Its sitecustomize.py runs in every Python
    process the command starts (and then runs the sitecustomize.py it hides);
    once a process imports torch it hooks optimizer creation and torch's global
    optimizer step pre-hook. Not reached: Python started with -I, -E or -S, and
    programs that are not Python.

    \b
    FILES
    RUN, RUN's parts and their rank files. An existing one is refused unless
    --overwrite (which removes them all first) or --resume is given.

    A recorder problem warns once in the program's stderr and training goes on, unless --strict. More:
    docs/launcher.md.
    """
    command = ctx.meta.get(_COMMAND) or []
    if not command:
        fail("no command to record: put it after --, as in: upd record runs/x.h5 -- python train.py")
    overwrite, resume = given["overwrite"], given["resume"]
    if overwrite and resume:
        fail("pass --overwrite or --resume, not both")
    chosen = {name: list(value) if isinstance(value, tuple) else value for name, value in given.items()
              if name != "overwrite"}
    # A repeatable flag not given means the option's default; the log dir is the one the user's shell meant.
    for field in FLAGS:
        if field.metadata["kind"] == options.CHOICES and not chosen[field.name]:
            chosen[field.name] = list(field.default)
    if chosen["tensorboard"]:
        chosen["tensorboard"] = os.path.abspath(chosen["tensorboard"])
    options_given = chosen
    check_options(options_given)
    existing = env.run_files(run)
    if existing and not (overwrite or resume):
        fail(f"{run} already holds a run ({', '.join(os.path.basename(f) for f in existing)}); pass --overwrite to "
             "replace it or --resume to continue it")
    if overwrite:
        for path in existing:
            try:
                os.remove(path)
            except OSError as exc:
                fail(f"cannot remove {path} for --overwrite: {exc.strerror or exc}")
    run_command(command, env.child_environment(run, options_given))


def check_options(options: dict) -> None:
    """Refuse option values upd.record would refuse, before the command starts (one line, exit 2), with the
    recorder's own checks (upd.recorder.options: no torch imported here)."""
    values = {k: v for k, v in options.items() if k not in ("include", "exclude", "ranks", "strict")}
    try:
        check_record_options(**values)
    except ValueError as exc:
        fail(str(exc))


def run_command(command: list[str], environ: dict) -> None:
    """Become `command` (exec): its exit status, streams and signals are the command's own, with no process of
    ours in between. Where exec does not replace the process (Windows), run it and exit with its status."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":
        sys.exit(subprocess.call(command, env=environ))
    # What exec keeps, the command should get as a shell would start it: Python ignores SIGPIPE and SIGXFSZ.
    # Put back if exec fails: a caller in this process (click's CliRunner) goes on with Python's own.
    kept = {}
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            kept[name] = signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvpe(command[0], command, environ)
    except OSError as exc:
        for name, handler in kept.items():
            signal.signal(getattr(signal, name), handler)
        if isinstance(exc, FileNotFoundError):
            fail(f"{command[0]}: command not found", 127)
        fail(f"{command[0]}: cannot execute: {exc.strerror or exc}", 126)
