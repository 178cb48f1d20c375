"""Hugging Face ``Trainer``: record a run without touching the training loop, which the Trainer owns.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[UpdCallback(every=10)])
    trainer.train()                                   # records into <output_dir>/upd-run.h5
    trainer_logs("out/upd-run.h5")                    # the loss and learning rate the Trainer logged

The Trainer builds its optimizer inside ``train()`` and hands callbacks Accelerate's ``AcceleratedOptimizer``
wrapper, so the recorder attaches in ``on_train_begin`` to the ``torch.optim.Optimizer`` inside it, and closes in
``on_train_end``. Gradient clipping, accumulation and the scheduler all act before or around ``optimizer.step()``,
where the recorder's step hooks see their result. In a distributed job the callback makes the same ``upd.record``
call on every process; its ``ranks=`` rules decide which ones write (rank 0 alone for replicated training).

The Trainer's own logs (loss, learning_rate, grad_norm, epoch, ...: every number of each ``on_log``) are logged
into the run like ``rec.log(..., after_step=True)``: they belong to the optimizer step just completed, and
``run.steps()`` and ``run.scalars()`` show them. ``trainer_logs`` reads them back as the Trainer's ``log_history``.
transformers is imported here only, and only this module needs it.
"""
from __future__ import annotations

import os

import pandas as pd
import torch

from ..recorder import record
from ..recorder.logged_scalars import name_problem, scalar_problem
from ..runfile import schema
from ..runfile.reader import open_run
from ._callback_base import RecorderCallback

# Works before torch-upd itself is installed from a clone, where "torch-upd[transformers]" cannot be resolved.
INSTALL_HINT = 'pip install transformers accelerate, or from a clone of torch-upd: pip install ".[transformers]"'
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


class UpdCallback(RecorderCallback, _CallbackBase):
    """A ``transformers.TrainerCallback`` that records the Trainer's optimizer with ``upd.record``.

    Args:
        path: the run file; default ``<args.output_dir>/upd-run.h5``.
        **record_options: passed to ``upd.record`` (``every``, ``stats_every``, ``include``, ``ranks``, ``strict``,
            ...). Unknown names are refused here, when the callback is made.

    A run that cannot be recorded (the file exists, an optimizer that is no ``torch.optim.Optimizer``) gives one
    ``upd.RecorderWarning`` and training goes on unrecorded, unless ``strict=True``. ``recorder`` is the
    ``upd.Recorder`` of the training in progress (None before, or when recording could not start).
    """

    FRAMEWORK, INSTALL_HINT, IMPORT_ERROR = "transformers", INSTALL_HINT, _IMPORT_ERROR

    def run_path(self, args) -> str:
        """Where this callback records for these TrainingArguments."""
        return self.path if self.path is not None else os.path.join(args.output_dir, DEFAULT_FILE)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        path = self.run_path(args)
        # _start first closes the recorder of an earlier train() that raised, never reaching on_train_end.
        self._start(path, "the Trainer's optimizer",
                    lambda: record(path, model, torch_optimizer(optimizer), **self.record_options))

    def on_log(self, args, state, control, logs=None, **kwargs):
        rec = self.recorder
        if rec is None or not logs:
            return
        # Every number the Trainer logged, after the optimizer step it reports on (state.global_step steps done).
        # A name rec.log refuses (a key column such as "step") is left out rather than stop the logging.
        values = {name: value for name, value in logs.items()
                  if name_problem(str(name)) is None and scalar_problem(value) is None}
        if values:
            rec.log(after_step=True, **values)

    def on_train_end(self, args, state, control, **kwargs):
        self._close()


def trainer_logs(run_or_path) -> pd.DataFrame:
    """What the Trainer logged during a recorded run (its ``state.log_history``): one row per logged step, columns
    ``step`` (the Trainer's ``global_step``: optimizer steps done) and whatever was logged (``loss``,
    ``learning_rate``, ``grad_norm``, ``epoch``, ...; NaN where a call did not log that name). Empty for a run
    recorded without UpdCallback. Accepts an open run or job, or a path.

    The logs are the run's logged scalars (``run.scalars()``, whose ``step`` is the recorder's: one less than the
    Trainer's ``global_step``), less the recorder's own total gradient norms."""
    if isinstance(run_or_path, (str, os.PathLike)):
        with open_run(run_or_path) as run:
            return trainer_logs(run)
    run = run_or_path
    ranks = getattr(run, "ranks", None)
    if isinstance(ranks, dict):  # a job: every recording rank stored the same logs
        return trainer_logs(ranks[min(ranks)]) if ranks else pd.DataFrame(columns=["step"])
    scalars = run.scalars()
    scalars = scalars[scalars["optimizer"] == 0] if len(scalars) else scalars
    names = [c for c in scalars.columns
             if c not in ("optimizer", "step", "wall_time") and c not in schema.RECORDER_SCALARS]
    table = scalars[["step", *names]].dropna(subset=names, how="all") if names else pd.DataFrame(columns=["step"])
    table = table.assign(step=table["step"] + 1)  # the Trainer's global_step counts the steps done
    return table.reset_index(drop=True)
