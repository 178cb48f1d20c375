"""Lightning's ``Trainer``: record a run without touching the training loop, which the Trainer owns.

    trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[UpdCallback(every=10)])
    trainer.fit(model, data)                        # records into <trainer.log_dir>/upd-run.h5

Lightning builds the optimizers in ``fit()`` (``configure_optimizers``), so the recorder attaches in
``on_train_start`` to ``trainer.optimizers`` (the torch optimizers themselves) and closes in ``on_train_end``, or in
``on_exception`` when training raises or is interrupted. The model passed on is ``trainer.model``: under DDP the
``DistributedDataParallel`` wrapper, which tells ``upd.record``'s ``ranks=`` rules that the replicas are identical
(rank 0 records alone), and whose ``module.`` prefix it strips from the names.

Automatic optimization calls ``optimizer.step(closure)``: the forward pass, the backward pass and gradient clipping
all run inside the step, in the closure, and the recorder takes the gradient (and counts the backward pass) when the
closure returns, clipped. Manual optimization steps through ``LightningOptimizer.step()``, which reaches the same
torch ``step(closure)`` with a closure that does nothing. Either way the training step's loss is stored in the run
after each optimizer step, with ``Recorder.log``. lightning is imported here only, and only this module needs it.

The Trainer's loggers get the statistics live, with no configuration, on the step axis they log the training's own
metrics on: a ``WandbLogger``'s run (``trainer/global_step``), an ``MLFlowLogger``'s run and a
``TensorBoardLogger``'s writer through the recorder's sinks, off the training thread; any other logger
(``CSVLogger``, ...) through its own ``log_metrics``, called on the training thread at the end of each batch, since
such a logger is not made to be called from another thread. ``UpdCallback(loggers=False)`` turns that off.
"""
from __future__ import annotations

import collections
import os

import torch

from ..recorder import record
from ..sinks import TensorBoard
from ..sinks.base import metrics
from ..sinks.mlflow import MLflow
from ..sinks.wandb import WandB
from ._callback_base import IdleSink, RecorderCallback, ShiftedSink, step_offset

INSTALL_HINT = 'pip install "torch-upd[lightning]"'
DEFAULT_FILE = "upd-run.h5"  # inside trainer.log_dir (the logger's version folder, else default_root_dir)
LOSS = "loss"  # the name the training step's loss has in what training_step returns, in self.log, and in the run
WANDB_STEP = "trainer/global_step"  # the x-axis WandbLogger defines for everything it logs

try:
    from lightning.pytorch import Callback as _CallbackBase
    _IMPORT_ERROR: ImportError | None = None
except ImportError as _exc:
    _CallbackBase = object
    _IMPORT_ERROR = _exc


def batch_loss(outputs, logged: dict, automatic: bool, accumulate: int) -> torch.Tensor | None:
    """The loss of one training batch, as ``training_step`` computed it: the loss it returned (`outputs`, as
    Lightning hands it to ``on_train_batch_end``; under automatic optimization divided by ``accumulate_grad_batches``
    = `accumulate`, the part of the step's gradient it makes: undone here), else the "loss" the module logged with
    ``self.log`` (`logged`: ``trainer.callback_metrics``; manual optimization's training_step often returns
    nothing). None when there is neither."""
    returned = outputs.get(LOSS) if isinstance(outputs, dict) else outputs
    if isinstance(returned, torch.Tensor) and returned.numel() == 1:
        return returned.detach() * accumulate if automatic else returned.detach()
    value = logged.get(LOSS)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach()
    return None


class UpdCallback(RecorderCallback, _CallbackBase):
    """A ``lightning.pytorch.Callback`` that records the Trainer's optimizers with ``upd.record``.

    Args:
        path: the run file; default ``<trainer.log_dir>/upd-run.h5`` (the logger's version folder, or
            ``default_root_dir`` without a logger).
        **record_options: passed to ``upd.record`` (``every``, ``stats_every``, ``include``, ``ranks``, ``strict``,
            ...). Unknown names are refused here, when the callback is made.

    The loss of each optimizer step (the mean of its batches' training-step losses, over gradient accumulation) is
    stored in the run as the scalar ``loss``. A run that cannot be recorded (the file exists, no optimizer) gives
    one ``upd.RecorderWarning`` and training goes on unrecorded, unless ``strict=True``. ``recorder`` is the
    ``upd.Recorder`` of the training in progress (None before, after, or when recording could not start).
    """

    FRAMEWORK, INSTALL_HINT, IMPORT_ERROR = "lightning", INSTALL_HINT, _IMPORT_ERROR

    def __init__(self, path=None, **record_options):
        super().__init__(path, **record_options)
        self._losses: list[torch.Tensor] = []  # the batches' losses since the last optimizer step
        self._global_step = 0  # trainer.global_step when the last batch ended
        self._log_losses = True  # False once Recorder.log refused a loss (warned once)
        self._queued: list[QueuedSink] = []  # the loggers written from the training thread

    def logger_sinks(self, trainer) -> list:
        """A sink per logger of the Trainer (on rank 0; placeholders on the others), on the step the Trainer logs
        the optimizer's next step at (the batches that stepped so far)."""
        loggers = list(trainer.loggers) if self.loggers else []
        if not trainer.is_global_zero:
            return [IdleSink() for _ in loggers]
        epoch_loop = trainer.fit_loop.epoch_loop
        offset = step_offset(getattr(epoch_loop, "_batches_that_stepped", trainer.global_step), trainer.optimizers[0])
        sinks = [self._logger_sink(f"the {type(logger).__name__}", lambda logger=logger: _sink(logger, offset))
                 for logger in loggers]
        self._queued = [sink for sink in sinks if isinstance(sink, QueuedSink)]
        return [sink for sink in sinks if sink is not None]

    def _drain(self) -> None:
        for sink in self._queued:
            sink.drain(self)

    def run_path(self, trainer) -> str:
        """Where this callback records for this Trainer (call it on every process: ``log_dir`` broadcasts)."""
        return self.path if self.path is not None else os.path.join(trainer.log_dir, DEFAULT_FILE)

    def on_train_start(self, trainer, pl_module):
        def attach():
            if not trainer.optimizers:
                raise TypeError("the LightningModule's configure_optimizers() returned no optimizer")
            # Made here, after _start closed an earlier fit's recorder and the loggers it wrote to.
            options = self._options_with(self.logger_sinks(trainer))
            return record(path, trainer.model, list(trainer.optimizers), **options)

        path = self.run_path(trainer)
        self._start(path, "the Trainer's optimizers", attach)  # closes an earlier fit() that raised past on_exception
        self._losses, self._global_step, self._log_losses = [], trainer.global_step, True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._drain()  # what the writer thread handed over for the thread-bound loggers
        rec = self.recorder
        if rec is None or not rec.active or not self._log_losses:
            return
        loss = batch_loss(outputs, trainer.callback_metrics, pl_module.automatic_optimization,
                          trainer.accumulate_grad_batches)
        if loss is not None:
            self._losses.append(loss)
        if trainer.global_step == self._global_step:
            return  # accumulating: no optimizer step in this batch
        self._global_step = trainer.global_step
        losses, self._losses = self._losses, []
        if not losses:
            return
        try:
            # To the step just completed (it replaces the loss the recorder took from automatic optimization's
            # closure: the last batch's alone, divided by accumulate_grad_batches). A tensor, not a float:
            # Recorder.log reads it with the step's one host copy, no device sync here.
            rec.log(after_step=True, **{LOSS: torch.stack([loss.reshape(()) for loss in losses]).float().mean()})
        except Exception as exc:  # a loss Recorder.log refuses: the steps go on being recorded, without it
            self._warn_unless_strict(exc, f"torch-upd: cannot store the training step's loss in {rec.path} "
                                          f"({type(exc).__name__}: {exc}); the steps go on being recorded without it.")
            self._log_losses = False

    def on_train_end(self, trainer, pl_module):
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        self._close()  # the steps recorded so far stay readable, and the file is closed cleanly

    def _close(self) -> None:
        self._losses = []
        super()._close()  # the recorder hands its last steps to the sinks as it closes
        self._drain()
        self._queued = []


def _sink(logger, offset: int):
    """The sink that writes into one Lightning logger."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    if isinstance(logger, WandbLogger):
        return WandB(logger.experiment, step_metric=WANDB_STEP, step_offset=offset)
    if isinstance(logger, MLFlowLogger):
        return MLflow(logger.run_id, tracking_uri=logger.experiment.tracking_uri, step_offset=offset)
    if isinstance(logger, TensorBoardLogger):
        return ShiftedSink(TensorBoard(logger.experiment), offset)
    return QueuedSink(logger, offset)


class QueuedSink:
    """Steps for a logger that is called on the training thread only: ``write`` (the recorder's writer thread)
    queues each step's metrics, ``drain`` (the callback, on the training thread) hands them to
    ``logger.log_metrics`` on the Trainer's step."""

    def __init__(self, logger, offset: int):
        self.logger, self.offset = logger, int(offset)
        self._rows: collections.deque = collections.deque()  # appended and popped from two threads

    def write(self, steps) -> None:
        for step in steps:
            row = metrics(step)
            if row:
                self._rows.append((step.step + self.offset, row))

    def drain(self, callback: RecorderCallback) -> None:
        if not self._rows:
            return
        try:
            while self._rows:
                step, row = self._rows.popleft()
                self.logger.log_metrics(row, step=step)
            self.logger.save()
        except Exception as exc:  # the logger refused: the steps go on being recorded, without it
            self._rows.clear()
            callback._queued = [q for q in callback._queued if q is not self]
            callback._warn_unless_strict(exc, f"torch-upd: cannot write the statistics to the "
                                              f"{type(self.logger).__name__} ({type(exc).__name__}: {exc}); "
                                              "recording goes on without it.", hook_depth=2)

    def close(self) -> None:
        pass
