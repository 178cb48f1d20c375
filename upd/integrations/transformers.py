"""Hugging Face ``Trainer``: record a run without touching the training loop, which the Trainer owns.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[UpdCallback(every=10)])
    trainer.train()                                   # records into <output_dir>/upd-run.h5
    trainer_logs("out/upd-run.h5")                    # the loss and learning rate the Trainer logged

The Trainer builds its optimizer inside ``train()`` and hands callbacks Accelerate's ``AcceleratedOptimizer``
wrapper, so the recorder attaches in ``on_train_begin`` to the ``torch.optim.Optimizer`` inside it, and closes in
``on_train_end``. Gradient clipping, accumulation and the scheduler all act before or around ``optimizer.step()``,
where the recorder's step hooks see their result. In a distributed job the callback makes the same ``upd.record``
call on every process; its ``ranks=`` rules decide which ones write (rank 0 alone for replicated training).

The Trainer's own logs (``state.log_history``: loss, learning_rate, grad_norm, ...) are stored in the run's root
attribute ``trainer_logs`` when training ends. transformers is imported here only, and only this module needs it.
"""
from __future__ import annotations

import inspect
import os
import warnings

import pandas as pd
import torch

from ..recorder import Recorder, RecorderWarning, record
from ..runfile import encoding, schema
from ..runfile.reader import open_run

INSTALL_HINT = 'pip install "torch-upd[transformers]"'
DEFAULT_FILE = "upd-run.h5"  # inside TrainingArguments.output_dir

try:
    from transformers import TrainerCallback as _CallbackBase
    _IMPORT_ERROR: ImportError | None = None
except ImportError as _exc:  # trainer_logs() still reads runs without transformers
    _CallbackBase = object
    _IMPORT_ERROR = _exc

# Wrappers seen around a torch optimizer (Accelerate's AcceleratedOptimizer, ...) hold it as `.optimizer`.
_MAX_WRAPPERS = 8


def torch_optimizer(optimizer):
    """The innermost ``torch.optim.Optimizer`` reached through ``.optimizer`` attributes; `optimizer` itself when
    there is none (``upd.record`` then says what it got). Innermost, because Accelerate's AcceleratedOptimizer
    subclasses torch.optim.Optimizer without being the one that steps: its own step hooks never run."""
    found, inner = optimizer, optimizer
    for _ in range(_MAX_WRAPPERS):
        inner = getattr(inner, "optimizer", None)
        if inner is None or inner is found:
            break
        if isinstance(inner, torch.optim.Optimizer):
            found = inner
    return found


class UpdCallback(_CallbackBase):
    """A ``transformers.TrainerCallback`` that records the Trainer's optimizer with ``upd.record``.

    Args:
        path: the run file; default ``<args.output_dir>/upd-run.h5``.
        **record_options: passed to ``upd.record`` (``every``, ``stats_every``, ``include``, ``ranks``, ``strict``,
            ...). Unknown names are refused here, when the callback is made.

    A run that cannot be recorded (the file exists, an optimizer that is no ``torch.optim.Optimizer``) gives one
    ``upd.RecorderWarning`` and training goes on unrecorded, unless ``strict=True``. ``recorder`` is the
    ``upd.Recorder`` of the training in progress (None before, or when recording could not start).
    """

    def __init__(self, path=None, **record_options):
        if _IMPORT_ERROR is not None:
            raise ImportError(f"UpdCallback needs the transformers package, which is not installed or not usable "
                              f"({_IMPORT_ERROR}): {INSTALL_HINT}")
        # A misspelt option would otherwise surface only as a warning once training starts.
        inspect.signature(Recorder).bind("path", None, None, **record_options)
        self.path = None if path is None else os.fspath(path)
        self.record_options = record_options
        self.recorder: Recorder | None = None

    def run_path(self, args) -> str:
        """Where this callback records for these TrainingArguments."""
        return self.path if self.path is not None else os.path.join(args.output_dir, DEFAULT_FILE)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._close(None)  # an earlier train() that raised never reached on_train_end
        path = self.run_path(args)
        try:
            self.recorder = record(path, model, torch_optimizer(optimizer), **self.record_options)
        except Exception as exc:  # training goes on without recording, as upd.record promises during training
            if self.record_options.get("strict", False):
                raise
            warnings.warn(f"torch-upd: cannot record the Trainer's optimizer to {path} ({type(exc).__name__}: "
                          f"{exc}); training continues without recording. Pass strict=True to raise instead.",
                          RecorderWarning, stacklevel=2)

    def on_train_end(self, args, state, control, **kwargs):
        self._close(state.log_history)

    def _close(self, log_history) -> None:
        rec, self.recorder = self.recorder, None
        if rec is None:
            return
        try:
            if log_history and rec.active:
                # Written once, at the end: rewriting a growing JSON attribute at every log would leave the
                # file's heap full of dead copies.
                rec._writer.set_attr(schema.ATTR_TRAINER_LOGS, encoding.jsonable(list(log_history)))
        except Exception as exc:
            if self.record_options.get("strict", False):
                rec.close()
                raise
            warnings.warn(f"torch-upd: cannot store the Trainer's logs in {rec.path} ({type(exc).__name__}: "
                          f"{exc}); the recorded steps stay readable.", RecorderWarning, stacklevel=3)
        rec.close()


def trainer_logs(run_or_path) -> pd.DataFrame:
    """What the Trainer logged during a recorded run (its ``state.log_history``): one row per log call, columns
    ``step`` and whatever was logged (``loss``, ``learning_rate``, ``grad_norm``, ``epoch``, ...; NaN where a call
    did not log that name). Empty for a run recorded without UpdCallback. Accepts an open run or job, or a path."""
    if isinstance(run_or_path, (str, os.PathLike)):
        with open_run(run_or_path) as run:
            return trainer_logs(run)
    run = run_or_path
    ranks = getattr(run, "ranks", None)
    if isinstance(ranks, dict):  # a job: every recording rank stored the same logs
        return trainer_logs(ranks[min(ranks)]) if ranks else pd.DataFrame(columns=["step"])
    check = run._validator()
    logs = check.json_attr(run._file, schema.ATTR_TRAINER_LOGS, "root", list, default=[], required=False)
    if not all(isinstance(entry, dict) for entry in logs):
        raise check.fail("root", f"attribute '{schema.ATTR_TRAINER_LOGS}' is not a JSON list of objects")
    table = pd.DataFrame(logs)
    if "step" not in table:
        table["step"] = pd.Series(dtype="int64")
    return table[["step"] + [c for c in table.columns if c != "step"]]
