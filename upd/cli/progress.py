"""A progress bar on stderr for the long commands (verify, analyze, the demo), drawn only when stderr is a terminal.

Piped or redirected, nothing is written: a log file or `2>&1 | tee` gets no carriage returns. Our own small bar
rather than tqdm (not a dependency) or click.progressbar (which still prints its label when not on a terminal).
"""
from __future__ import annotations

import sys
import time

import click

BAR_CHARS = 30
REDRAW_SECONDS = 0.1  # at most 10 redraws a second: a fast loop is not slowed by its bar


class Progress:
    """`with Progress("verifying") as bar: bar.update(done, total)` (or `bar.advance(n)` after `bar.total = N`).
    Each call redraws one line on stderr, at most every REDRAW_SECONDS; the line is cleared at the end. Does nothing
    unless stderr is a terminal (or `stream` is given, for a test)."""

    def __init__(self, label: str, total: float = 0, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.shown = stream is not None or self.stream.isatty()
        except (AttributeError, ValueError):  # a closed or replaced stream
            self.shown = False
        self.label, self.total, self.done = label, total, 0.0
        self.started = time.monotonic()
        self._drawn_at = 0.0
        self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, done: float, total: float | None = None, label: str | None = None) -> None:
        if total is not None:
            self.total = total
        relabelled = label is not None and label != self.label
        if relabelled:
            self.label = label
        self.done = done
        now = time.monotonic()
        if self.shown and (now - self._drawn_at >= REDRAW_SECONDS or relabelled):
            self._drawn_at = now
            self._draw(now)

    def advance(self, amount: float = 1, label: str | None = None) -> None:
        self.update(self.done + amount, label=label)

    def stage(self, label: str) -> None:
        """A new stage of work whose size is not known: its name, with the time so far."""
        self.update(self.done, label=label)

    def _draw(self, now: float) -> None:
        elapsed = now - self.started
        if self.total:
            share = min(1.0, max(0.0, self.done / self.total))
            filled = int(share * BAR_CHARS)
            eta = f", {elapsed / share - elapsed:.0f} s left" if 0.02 < share < 1 and elapsed > 2 else ""
            text = f"{self.label} [{'#' * filled}{'.' * (BAR_CHARS - filled)}] {100 * share:3.0f}%{eta}"
        else:
            text = f"{self.label} ({elapsed:.0f} s)"
        self.stream.write("\r\x1b[K" + text)  # our own line: carriage return, clear to its end
        self.stream.flush()
        self._drawn = True

    def echo(self, text: str) -> None:
        """A line of the command's own output (stdout): the bar is cleared first and redrawn at the next update."""
        self.close()
        click.echo(text)

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")  # leave no bar behind: the command's output follows on a clean line
            self.stream.flush()
            self._drawn = False
