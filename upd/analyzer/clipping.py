"""Was gradient clipping active? The answer from two total gradient norms the recorder logs at each recorded step.

``total_grad_norm_backward`` is the norm over all of an optimizer's gradients when the last backward pass before
the step ended, ``total_grad_norm_step`` the norm the step saw (docs/format.md, the scalars table). Clipping
rescales the gradients in between, so a clipped step shows as the second smaller than the first, and the second
is then the clipping threshold (``clip_grad_norm_(max_norm)`` rescales to max_norm). Reading ``run.stats()`` by
hand for this took a practitioner a while; this module does it once, as pure functions of the scalars table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..runfile import schema

# A step whose norm shrank by less than this fraction is not called clipped: clip_grad_norm_ rescales by
# max_norm / (norm + 1e-6), and two norms of the same gradients differ in the last bits between reductions.
CLIPPED_RTOL = 1e-3
# torch.amp.GradScaler's unscaling divides the gradients by a power of two between backward and step: a ratio
# within this of an exact power of two (other than 1) is unscaling, not clipping.
POWER_OF_TWO_TOL = 1e-4

STEP_COLUMNS = ["optimizer", "step", "norm_backward", "norm_step", "ratio", "clipped", "unscaled"]


def clipping_by_step(scalars: pd.DataFrame) -> pd.DataFrame:
    """One row per step where both norms were measured (and are finite): optimizer, step, norm_backward, norm_step,
    ratio (step / backward), clipped (the step's gradients were scaled down, not by a power of two), unscaled (a
    power-of-two ratio: GradScaler's unscaling)."""
    needed = {"optimizer", "step", schema.SCALAR_GRAD_NORM_BACKWARD, schema.SCALAR_GRAD_NORM_AT_STEP}
    if not needed <= set(scalars.columns):
        return pd.DataFrame(columns=STEP_COLUMNS)
    table = scalars[["optimizer", "step", schema.SCALAR_GRAD_NORM_BACKWARD, schema.SCALAR_GRAD_NORM_AT_STEP]]
    table = table.rename(columns={schema.SCALAR_GRAD_NORM_BACKWARD: "norm_backward",
                                  schema.SCALAR_GRAD_NORM_AT_STEP: "norm_step"})
    before = table["norm_backward"].to_numpy(dtype=float)
    after = table["norm_step"].to_numpy(dtype=float)
    measured = np.isfinite(before) & np.isfinite(after) & (before > 0)
    table = table[measured].reset_index(drop=True)
    ratio = table["norm_step"].to_numpy(dtype=float) / table["norm_backward"].to_numpy(dtype=float)
    with np.errstate(divide="ignore"):
        exponent = np.log2(np.where(ratio > 0, ratio, np.nan))
    unscaled = (np.abs(exponent - np.round(exponent)) < POWER_OF_TWO_TOL) & (np.round(exponent) != 0)
    clipped = (ratio < 1 - CLIPPED_RTOL) & ~unscaled
    return table.assign(ratio=ratio, clipped=clipped, unscaled=unscaled)[STEP_COLUMNS]


@dataclass(frozen=True)
class ClippingSummary:
    """One optimizer's clipping over the steps where both norms were measured."""

    optimizer: int
    measured_steps: int
    clipped_steps: int
    unscaled_steps: int  # power-of-two ratios: GradScaler's unscaling (the backward norm is of scaled gradients)
    median_norm_backward: float  # median total norm before clipping, over the measured steps
    clipped_to: float | None  # median total norm the step saw, over the clipped steps (the threshold)
    median_norm_clipped: float | None = None  # median total norm before clipping, over the clipped steps
    last_clipped_step: int | None = None  # clipping during warm-up only, or to the end: the step says which

    def text(self) -> str:
        """One line for ``upd info`` and ``upd analyze``. The clipped steps' own pre-clip median is given beside the
        median over all steps: with clipping on a few steps only, the second alone sits below the threshold and
        reads as a contradiction."""
        if self.clipped_steps == self.measured_steps:
            line = (f"gradient clipped to {self.clipped_to:.3g} on {self.clipped_steps}/{self.measured_steps} steps "
                    f"(pre-clip total norm median {self.median_norm_backward:.3g})")
        elif self.clipped_steps:
            line = (f"gradient clipped to {self.clipped_to:.3g} on {self.clipped_steps}/{self.measured_steps} steps, "
                    f"the last at step {self.last_clipped_step} (pre-clip total norm median "
                    f"{self.median_norm_clipped:.3g} on those, {self.median_norm_backward:.3g} over all "
                    f"{self.measured_steps})")
        else:
            line = (f"gradient not clipped ({self.measured_steps} steps measured; total norm median "
                    f"{self.median_norm_backward:.3g})")
        if self.unscaled_steps:
            line += (f"; {self.unscaled_steps} steps unscaled by a power of two between backward and step "
                     "(GradScaler: their backward norm is of the scaled gradients)")
        return (f"optimizer {self.optimizer}: " if self.optimizer else "") + line


def summarize_clipping(scalars: pd.DataFrame) -> list[ClippingSummary]:
    """A ClippingSummary per optimizer with measured steps (none for a run recorded without the norms)."""
    by_step = clipping_by_step(scalars)
    out = []
    for optimizer, rows in by_step.groupby("optimizer", sort=True):
        clipped = rows[rows["clipped"].astype(bool)]
        out.append(ClippingSummary(
            optimizer=int(optimizer), measured_steps=len(rows), clipped_steps=len(clipped),
            unscaled_steps=int(rows["unscaled"].astype(bool).sum()),
            median_norm_backward=float(np.median(rows["norm_backward"].to_numpy(dtype=float))),
            clipped_to=float(np.median(clipped["norm_step"].to_numpy(dtype=float))) if len(clipped) else None,
            median_norm_clipped=float(np.median(clipped["norm_backward"].to_numpy(dtype=float))) if len(clipped)
            else None,
            last_clipped_step=int(clipped["step"].max()) if len(clipped) else None))
    return out


def clipping_lines(run) -> list[str]:
    """The lines ``upd info`` and ``upd analyze`` print: one per optimizer whose norms were recorded."""
    return [s.text() for s in summarize_clipping(run.scalars()) if not math.isnan(s.median_norm_backward)]
