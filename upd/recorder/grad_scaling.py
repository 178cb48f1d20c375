"""Mixed precision: a step that ``torch.amp.GradScaler`` hands to a fused optimizer, recorded as the optimizer did it.

GradScaler unscales the gradients itself (``scaler.unscale_``, or inside ``scaler.step``) before a plain or foreach
optimizer steps, and skips that step altogether when it finds an inf/NaN: the recorder's hooks then see unscaled
gradients, or no step. A *fused* optimizer (``fused=True``: Adam, AdamW, SGD, Adagrad; ``_step_supports_amp_scaling``)
is stepped instead with two tensors set on it for the duration of ``optimizer.step()`` (torch/amp/grad_scaler.py):

- ``optimizer.grad_scale``: the scale the gradients still carry, which the fused kernel divides out (and writes the
  unscaled gradient back in place); None when ``scaler.unscale_(optimizer)`` ran before (they are unscaled already);
- ``optimizer.found_inf``: 1.0 when an inf/NaN was found in the gradients. The kernel then changes nothing: neither
  the parameters nor the optimizer state, and the step counter it had incremented is taken back.

The step pre-hook sees both, and the gradients still scaled. The recorder records them as the scalars
``amp_grad_scale`` (1 when the gradients came unscaled) and ``amp_found_inf`` at every such step, divides the total
gradient norms it measured by the scale (left on the device), and after the step divides the gradient statistics and
the stored gradient of a full record by it: what the run shows is the gradient the optimizer effectively used.
Statistics scale with the gradient as the vocabulary says (``upd.statistics``): mean, std, norm and abs max by
1/scale, zero fraction and NaN/Inf count unchanged, grad:data recomputed from the divided std. GradScaler's scales
are powers of two, so the division is exact: the run reads as the same run without a scaler would.

``total_grad_norm_backward`` is measured when the backward pass ends, on the scaled gradients: divided by
``optimizer.grad_scale`` where the step is handed one; after ``scaler.unscale_`` the step is given no scale, and the
backward norm stays the norm of the scaled gradients (docs/format.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ratios import grad_to_data
from ..runfile import schema
from ..runfile.stats_table import StatsRows
from .snapshots import wait_for_copies
from ..statistics import ABSMAX, GRAD, GRAD_TO_DATA, MEAN, NORM, PARAM, STD, column

# The gradient statistics that scale with the gradient (the others of ``statistics.STATS``, the fraction of zeros
# and the NaN/Inf count, do not change when every element is divided by the same number).
SCALED_COLUMNS = tuple(column(GRAD, stat) for stat in (MEAN, STD, NORM, ABSMAX))
GRAD_STD, PARAM_STD = column(GRAD, STD), column(PARAM, STD)


@dataclass(frozen=True)
class GradScaling:
    """What GradScaler handed one fused optimizer step (tensors on the device, copied: the scaler updates its own
    scale in place after the step)."""

    grad_scale: torch.Tensor | None  # the factor the step's gradients still carry; None: they were unscaled already
    found_inf: torch.Tensor  # nonzero: the fused kernel skipped the step

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> GradScaling | None:
        """The scaling of the step about to run (called from the step pre-hook), None where GradScaler handed it
        none (no scaler, or an optimizer the scaler unscales for and steps only when its gradients are finite)."""
        found_inf = getattr(optimizer, "found_inf", None)
        if not isinstance(found_inf, torch.Tensor):
            return None
        scale = getattr(optimizer, "grad_scale", None)
        return cls(grad_scale=scale.detach().reshape(()).clone() if isinstance(scale, torch.Tensor) else None,
                   found_inf=found_inf.detach().reshape(()).clone())

    def add_scalars(self, scalars: dict) -> None:
        """Into the step's measured scalars: the scale and found_inf, and the total gradient norms measured on the
        scaled gradients divided by the scale (on the device: nothing waits here)."""
        if self.grad_scale is not None:
            for name in (schema.SCALAR_GRAD_NORM_BACKWARD, schema.SCALAR_GRAD_NORM_AT_STEP):
                if isinstance(scalars.get(name), torch.Tensor):
                    scalars[name] = scalars[name] / self.grad_scale.to(scalars[name].device)
        scalars[schema.SCALAR_AMP_GRAD_SCALE] = self.grad_scale if self.grad_scale is not None else 1.0
        scalars[schema.SCALAR_AMP_FOUND_INF] = self.found_inf

    def scale_on_host(self) -> float:
        """The scale as a number (1.0 when the gradients came unscaled); reads the device."""
        return 1.0 if self.grad_scale is None else float(self.grad_scale)

    def unscaled(self, stats):
        """A finished step's statistics as the optimizer used the gradients (``unscaled_statistics``), read after
        the step's one host copy."""
        scale = self.scale_on_host()
        return stats if scale == 1.0 else unscaled_statistics(stats, scale)

    def unscale_grads(self, snapshots) -> None:
        """The gradients a full record stores (the recorder's own host copies, ``snapshots.cpu_copy``) divided by
        the scale in place, as the fused kernel divides them."""
        scale = self.scale_on_host()
        if scale == 1.0:
            return
        wait_for_copies()
        for snap in snapshots:
            if snap.grad is not None:
                snap.grad.div_(scale)


def unscaled_statistics(stats, scale: float):
    """One step's statistics ({name: {column: value}} or a StatsRows table) with the gradient's divided by `scale`
    and grad:data recomputed from them. A dict is changed in place, a table's array too."""
    if isinstance(stats, StatsRows):
        columns = list(stats.columns)
        table = stats.table
        for name in SCALED_COLUMNS:
            if name in columns:
                table[:, columns.index(name)] /= scale
        if GRAD_TO_DATA in columns and GRAD_STD in columns and PARAM_STD in columns:
            # The ratio stays NaN where the table marks no gradient (its std is NaN there too).
            table[:, columns.index(GRAD_TO_DATA)] = np.asarray(grad_to_data(
                table[:, columns.index(GRAD_STD)], table[:, columns.index(PARAM_STD)]), dtype=table.dtype)
        return stats
    for values in stats.values():
        for name in SCALED_COLUMNS:
            if name in values:
                values[name] = values[name] / scale
        if GRAD_TO_DATA in values and GRAD_STD in values:
            values[GRAD_TO_DATA] = float(grad_to_data(values[GRAD_STD], values.get(PARAM_STD, float("nan"))))
    return stats
