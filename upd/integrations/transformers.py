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

The integrations the Trainer reports to (``report_to=["wandb"]``, ``["mlflow"]``, ``["tensorboard"]``) get the
statistics live, with no configuration: into the same run the Trainer logs to (``wandb.run``, MLflow's active run,
the ``TensorBoardCallback``'s log dir), on the Trainer's step axis (its ``global_step``, W&B's
``train/global_step``), through the recorder's sinks, off the training thread. ``UpdCallback(loggers=False)`` turns
that off.
"""
from __future__ import annotations

import os
import sys

import pandas as pd
import torch

from ..recorder import record
from ..recorder.logged_scalars import name_problem, scalar_problem
from ..runfile import schema
from ..runfile.opening import open_run
from ..sinks import TensorBoard
from ..sinks.mlflow import MLflow
from ..sinks.wandb import WandB
from ._callback_base import IdleSink, RecorderCallback, ShiftedSink, step_offset

# Works before torch-upd itself is installed from a clone, where "torch-upd[transformers]" cannot be resolved.
INSTALL_HINT = 'pip install transformers accelerate, or from a clone of torch-upd: pip install ".[transformers]"'
DEFAULT_FILE = "upd-run.h5"  # inside TrainingArguments.output_dir
WANDB_STEP = "train/global_step"  # the x-axis the Trainer's WandbCallback defines for everything it logs
REPORTED = ("wandb", "mlflow", "tensorboard")  # the report_to integrations the statistics go to
_HANDLER_DEPTH = 4  # frames up from a hook to the Trainer's CallbackHandler.call_event

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

    def logger_sinks(self, args, state, optimizer, callbacks: list) -> list:
        """A sink into each integration of ``args.report_to`` that torch-upd writes to (on rank 0; a placeholder on
        the others), on the Trainer's ``global_step``: the optimizer's next step is ``state.global_step + 1``."""
        # getattr: a hand-made call (a test, another loop driving the callback) may give bare arguments.
        report_to = getattr(args, "report_to", None) or ()
        reported = [name for name in REPORTED if name in report_to] if self.loggers else []
        if not reported:
            return []
        if not state.is_world_process_zero:
            return [IdleSink() for _ in reported]
        offset = step_offset(state.global_step + 1, optimizer)
        made = {"wandb": lambda: _wandb_sink(offset), "mlflow": lambda: _mlflow_sink(offset, logging_interval(args)),
                "tensorboard": lambda: _tensorboard_sink(callbacks, offset)}
        sinks = [self._logger_sink(f"the Trainer's {name} run", made[name]) for name in reported]
        return [sink for sink in sinks if sink is not None]

    def _trainer_callbacks(self) -> list:
        """The Trainer's callbacks, from the CallbackHandler whose call_event is calling this callback's hook (call
        this from the hook itself): a callback is not handed the Trainer, and the TensorBoardCallback's log dir (it
        chooses its own) is reachable only there."""
        frame = sys._getframe(1)
        for _ in range(_HANDLER_DEPTH):
            frame = frame.f_back
            if frame is None:
                break
            callbacks = getattr(frame.f_locals.get("self"), "callbacks", None)
            if isinstance(callbacks, list) and any(c is self for c in callbacks):
                return callbacks
        return []

    def run_path(self, args) -> str:
        """Where this callback records for these TrainingArguments."""
        return self.path if self.path is not None else os.path.join(args.output_dir, DEFAULT_FILE)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        path = self.run_path(args)
        inner = torch_optimizer(optimizer)
        options = self._options_with(self.logger_sinks(args, state, inner, self._trainer_callbacks()))
        # _start first closes the recorder of an earlier train() that raised, never reaching on_train_end.
        self._start(path, "the Trainer's optimizer", lambda: record(path, model, inner, **options))

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


def _wandb_sink(offset: int):
    import wandb

    return None if wandb.run is None else WandB(wandb.run, step_metric=WANDB_STEP, step_offset=offset)


def logging_interval(args) -> int:
    """The steps between two of the Trainer's logs (logging_strategy "steps" with a whole logging_steps), else 1."""
    steps = args.logging_steps
    if str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "steps" or steps < 1 or steps % 1:
        return 1
    return int(steps)


def _mlflow_sink(offset: int, every: int):
    import mlflow

    active = mlflow.active_run()  # the Trainer's MLflowCallback started it on this thread
    if active is None:
        return None
    # At the Trainer's logging steps: MLflow's store costs about 0.1 ms per metric (upd.sinks.mlflow).
    return MLflow(active.info.run_id, tracking_uri=mlflow.get_tracking_uri(), step_offset=offset, every=every)


def _tensorboard_sink(callbacks: list, offset: int):
    # A writer of its own in the TensorBoardCallback's log dir (TensorBoard shows one run per folder): that callback
    # closes its writer in on_train_end, before this callback's on_train_end closes the recorder, whose last steps
    # are then still to be written.
    folders = [c.logging_dir for c in callbacks if type(c).__name__ == "TensorBoardCallback"
               and getattr(c, "logging_dir", None)]
    return ShiftedSink(TensorBoard(folders[0]), offset) if folders else None


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
