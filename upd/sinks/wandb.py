"""Weights & Biases: a recording's statistics, live, in the W&B run the user already has (or one it starts).

    wandb.init(project="my-project")                                   # optional: the run to write into
    upd.record("run.h5", model, optimizer, sinks=[upd.sinks.WandB()])  # the active run, else one it starts

Each recorded step becomes one ``run.log`` call holding every tag of ``upd.sinks.base.metrics`` (``update_to_data/
<param>``, ..., ``scalars/<name>``) and the step under ``step_metric``. The step axis: the recorder hands steps over
in batches, off the training thread, up to a batch after they happened, while the user's own ``wandb.log`` calls
have moved W&B's own row counter (``_step``) on; W&B drops a ``log(step=N)`` below that counter, so ``step=`` is
never passed. Instead every row carries its step as a value, and ``define_metric`` makes that value the x-axis of
torch-upd's tags: ``upd/step`` (the recorder's step) by default, or the axis the run already uses, e.g. the Hugging
Face Trainer's ``train/global_step`` or Lightning's ``trainer/global_step`` (``step_metric=``, with ``step_offset=``
from the recorder's step to that axis: the integrations' callbacks set both). Values arrive on the host: no device
synchronisation here. Works offline (``WANDB_MODE=offline``). wandb is imported when a sink is made, never before.
"""
from __future__ import annotations

from typing import Sequence

from .base import LIVE_COLUMNS, SCALARS_SECTION, SinkStep, metrics

STEP_METRIC = "upd/step"  # the x-axis of torch-upd's tags in a run that has none of its own
# Works before torch-upd itself is installed from a clone, where "torch-upd[wandb]" cannot be resolved.
INSTALL_HINT = 'pip install wandb, or from a clone of torch-upd: pip install ".[wandb]"'


def import_wandb():
    """The wandb module, or one ImportError that says how to install it."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(f"the W&B sink needs the wandb package, which is not installed or not usable ({exc}): "
                          f"{INSTALL_HINT}") from exc
    return wandb


class WandB:
    """A live sink into a W&B run.

    Args:
        run: the ``wandb`` run to write into; default the active one (``wandb.run``), else a new one started here
            with ``wandb.init(**init_options)`` (project, name, mode, ... ; the ``WANDB_*`` variables apply) and
            finished by ``close()``. A run given or found is left open.
        step_metric: the name of the x-axis value each row carries (see the module's docstring).
        step_offset: added to the recorder's step to give ``step_metric``'s value (1 for a Trainer's global step,
            which counts the steps done).
        every: write the steps whose ``step_metric`` value is a multiple of this (default 1: all).
    """

    def __init__(self, run=None, *, step_metric: str = STEP_METRIC, step_offset: int = 0, every: int = 1,
                 **init_options):
        if int(every) < 1:
            raise ValueError(f"WandB: every must be a positive number of steps, not {every!r}")
        wandb = import_wandb()
        if run is None:
            run = wandb.run
        if run is not None and init_options:
            raise TypeError(f"WandB: wandb.init options ({', '.join(sorted(init_options))}) apply only to a run the "
                            "sink starts, and a run is already active")
        self.owns_run = run is None
        self.run = wandb.init(**init_options) if run is None else run
        self.step_metric = str(step_metric)
        self.step_offset = int(step_offset)
        self.every = int(every)
        self.closed = False
        self.run.define_metric(self.step_metric)
        for section in (*LIVE_COLUMNS, SCALARS_SECTION):
            self.run.define_metric(f"{section}/*", step_metric=self.step_metric)

    def write(self, steps: Sequence[SinkStep]) -> None:
        """One ``run.log`` per step, in the order given."""
        if self.closed:
            raise ValueError("the WandB sink is closed")
        for step in steps:
            at = step.step + self.step_offset
            row = metrics(step) if at % self.every == 0 else None
            if row:
                row[self.step_metric] = at
                self.run.log(row)

    def close(self) -> None:
        """Finish the run if this sink started it; a run given or found stays open. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.owns_run:
            self.run.finish()

    def __repr__(self) -> str:
        return f"<upd.sinks.WandB run {getattr(self.run, 'id', '?')}{' (closed)' if self.closed else ''}>"
