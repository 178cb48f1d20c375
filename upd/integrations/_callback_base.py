"""What the Trainer callbacks (Lightning's and the Hugging Face Trainer's ``UpdCallback``) have in common, written
once so that both keep the same promises.

A Trainer owns the training loop and builds its optimizers only once training starts, so both callbacks check their
``upd.record`` options when they are made (a misspelt option would otherwise surface only as a warning mid-run),
attach the recorder in the Trainer's train-start hook, and close it on the way out. Both follow ``upd.record``'s rule
that recording never breaks training: a recorder that cannot start, or a value the run refuses, gives one
``upd.RecorderWarning`` and training goes on (``strict=True`` raises instead). Neither framework is imported here:
each callback's own module imports its framework and mixes this class into the framework's callback class.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from typing import Callable, Sequence

from ..recorder import Recorder, RecorderWarning
from ..recorder.resume import initial_step


class RecorderCallback:
    """The recorder's life in a Trainer callback. A subclass sets the class attributes below, calls ``_start`` from
    its train-start hook and ``_close`` from its train-end (and exception) hooks."""

    FRAMEWORK = ""  # the package the callback needs, as the ImportError names it
    INSTALL_HINT = ""  # how to install it
    IMPORT_ERROR: ImportError | None = None  # why importing the framework failed, or None

    def __init__(self, path=None, loggers: bool = True, **record_options):
        if self.IMPORT_ERROR is not None:
            raise ImportError(f"UpdCallback needs the {self.FRAMEWORK} package, which is not installed or not usable "
                              f"({self.IMPORT_ERROR}): {self.INSTALL_HINT}")
        # A misspelt option would otherwise surface only as a warning once training starts.
        inspect.signature(Recorder).bind("path", None, None, **record_options)
        self.path = None if path is None else os.fspath(path)
        self.record_options = record_options
        self.loggers = bool(loggers)  # write the statistics to the Trainer's own loggers too
        self.recorder: Recorder | None = None

    @property
    def strict(self) -> bool:
        return bool(self.record_options.get("strict", False))

    def _start(self, path: str, what: str, attach: Callable[[], Recorder]) -> None:
        """Record with the Recorder `attach()` returns (it calls ``upd.record``); the recorder of an earlier
        training that raised past the end hooks is closed first. When `attach` raises, one warning naming `what`
        (the optimizers) and `path`, and training goes on unrecorded; under strict=True the error itself."""
        self._close()
        try:
            self.recorder = attach()
        except Exception as exc:  # training goes on without recording, as upd.record promises during training
            self._warn_unless_strict(exc, f"torch-upd: cannot record {what} to {path} ({type(exc).__name__}: {exc}); "
                                          "training continues without recording. Pass strict=True to raise instead.",
                                     hook_depth=2)

    def _options_with(self, sinks: list) -> dict:
        """upd.record's options, with `sinks` (the Trainer's loggers') after the user's own (upd.record then takes
        statistics at every step unless the user chose otherwise)."""
        if not sinks:
            return self.record_options
        return {**self.record_options, "sinks": [*self.record_options.get("sinks", ()), *sinks]}

    def _logger_sink(self, what: str, make: Callable[[], object]):
        """The sink `make()` returns for one of the Trainer's loggers (None: that logger has nothing to write to),
        or None with one warning when making it raises: the loggers are an extra, training and recording go on."""
        try:
            return make()
        except Exception as exc:
            self._warn_unless_strict(exc, f"torch-upd: cannot write the statistics to {what} ({type(exc).__name__}: "
                                          f"{exc}); recording goes on without it.", hook_depth=3)
            return None

    def _warn_unless_strict(self, exc: Exception, message: str, hook_depth: int = 1) -> None:
        """Called while handling `exc`: re-raise it under strict=True, else warn `message` (once: the caller stops
        doing what failed). `hook_depth`: the calls between the Trainer's hook call and this one, so that the
        warning points at the Trainer's line."""
        if self.strict:
            raise exc
        warnings.warn(message, RecorderWarning, stacklevel=2 + hook_depth)

    def _close(self) -> None:
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.close()


def step_offset(trainer_step: int, optimizer) -> int:
    """What to add to the recorder's step (the optimizer's own count, which a resumed optimizer continues) to get a
    Trainer's step, `trainer_step` being the Trainer's step of the optimizer's next step."""
    return int(trainer_step) - initial_step(optimizer)


class ShiftedSink:
    """A sink whose steps are moved onto a Trainer's step axis before they reach `sink` (a TensorBoard writer's
    global_step, a logger's step)."""

    def __init__(self, sink, offset: int):
        self.sink, self.offset = sink, int(offset)

    def write(self, steps: Sequence) -> None:
        self.sink.write([dataclasses.replace(s, step=s.step + self.offset) for s in steps] if self.offset else steps)

    def close(self) -> None:
        self.sink.close()


class IdleSink:
    """The place of a Trainer logger's sink on a process that has no logger run (every rank but 0): the recorder
    calls sinks on rank 0 alone, and every rank passes the same list."""

    def write(self, steps: Sequence) -> None:
        pass

    def close(self) -> None:
        pass
