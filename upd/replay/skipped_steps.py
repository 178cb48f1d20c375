"""Steps a fused optimizer skipped because ``torch.amp.GradScaler`` found an inf/NaN gradient, replayed as what the
fused kernel did: nothing.

GradScaler hands a fused optimizer (``fused=True``) its step with ``optimizer.found_inf`` set instead of skipping
``optimizer.step()`` (torch/amp/grad_scaler.py); the kernel then leaves the parameters and the optimizer state as
they were, and takes back the step counter it had incremented (torch/optim/adam.py, ``_fused_adam``). The recorder
saw the step and wrote it, with the scalar ``amp_found_inf`` = 1 (upd/recorder/grad_scaling.py). Replaying the
optimizer's math on it would report a mismatch where torch did exactly what it promises.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..runfile import schema
from ..runfile.reader import OptimizerRun
from .registry import STEP_KEY, Replayed, ReplayRule

NOTE = ("skipped by the fused optimizer: GradScaler found an inf/NaN gradient (amp_found_inf); replayed as no "
        "change to the parameter, the state and the step counter")


def skipped_steps(opt: OptimizerRun) -> frozenset:
    """The optimizer steps its scalars table marks with ``amp_found_inf`` (a value other than 0 and NaN)."""
    scalars = opt.scalars()
    if schema.SCALAR_AMP_FOUND_INF not in scalars.columns or scalars.empty:
        return frozenset()
    found = scalars[schema.SCALAR_AMP_FOUND_INF].to_numpy(dtype=np.float64)
    steps = scalars[schema.STEP].to_numpy()
    return frozenset(int(s) for s, f in zip(steps, found) if f == f and f != 0)


def unchanged(rule: ReplayRule) -> ReplayRule:
    """`rule` for a skipped step: the parameter and the state as recorded before it, the step counter included
    (on the optimizer's first step the state the optimizer creates, its counter at 0)."""
    def no_change(param, grad, state, group, step):
        state = dict(state)
        if rule.counts_steps:
            state.setdefault(STEP_KEY, 0)  # counted, then taken back
        return Replayed(param, state)
    return dataclasses.replace(rule, fn=no_change, counts_steps=False)
