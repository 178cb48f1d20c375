"""What every `upd` command shares: the exit codes, the one-line failure, the RUN argument, the error-catching group."""
from __future__ import annotations

import os
import sys

import click

from ..outputs import OutputError
from ..exit_codes import EXIT_INTERRUPTED, EXIT_UNUSABLE
from ..runfile.reader import RunFileError
from ..safe_text import terminal_safe

EXIT_CODES = """\b
Exit codes:
    0  success (verify: every checked step matched)
    1  verify: at least one recorded update differs from the replay
    2  unusable input: missing or unreadable file, not a torch-upd run, bad option
    3  verify: nothing verifiable (no replay rule for the optimizer, what the
       replay needs was not recorded, or every check inconclusive: the
       storage precision cannot tell the update from none)
    4  verify: a replay rule failed (raised an error: a bug in the rule, named
       with the step and parameter, not in the run file)
  130  interrupted (Ctrl-C): nothing was concluded
"""


def fail(message: str, code: int = EXIT_UNUSABLE) -> None:
    click.echo(f"upd: error: {terminal_safe(message)}", err=True)  # it may quote the file: one safe line
    sys.exit(code)


class ErrorLineGroup(click.Group):
    def main(self, *args, standalone_mode: bool = True, **kwargs):
        # click's own usage errors are a usage block, a hint and the error (four lines): one line here, like every
        # other error, with where to look.
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            fail(exc.format_message() + where, exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:  # click's name for Ctrl-C (KeyboardInterrupt) and for end of input at a prompt
            click.echo("upd: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(result if isinstance(result, int) else 0)

    def invoke(self, ctx):
        # One clear line and exit 2 for a bad file, never a traceback; UPD_DEBUG=1 shows tracebacks of real bugs.
        try:
            return super().invoke(ctx)
        except (RunFileError, OutputError) as exc:
            fail(str(exc))
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit, KeyboardInterrupt):
            raise
        except MemoryError:  # the reading budget keeps hostile files from this: a valid run too big for this machine
            fail("not enough memory on this machine for this run (docs/reliability.md, \"The reading budget\")")
        except Exception as exc:
            if os.environ.get("UPD_DEBUG"):
                raise
            fail(f"{type(exc).__name__}: {exc} (set UPD_DEBUG=1 for a traceback)")


WIDE_OPTION = click.option("--wide", is_flag=True,
                           help="Print every column of the tables and names up to 200 characters (default: fit 100 "
                                "columns, long names shortened in the middle with '\u2026'; --json or the CSV files "
                                "hold every name whole).")

# readable=False: the reader reports an unreadable file in its own one line (click would print a usage error).
RUN_ARG = click.argument("run", type=click.Path(dir_okay=True, readable=False, path_type=str))
