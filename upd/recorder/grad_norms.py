"""Total gradient norms: as the backward pass accumulated them, and as the optimizer step saw them.

Gradient clipping (``clip_grad_norm_``), GradScaler's unscaling or any other change between ``backward()`` and
``optimizer.step()`` rewrites the gradients in place, so the step pre-hook sees only their result. To say whether
clipping was active the recorder also needs the norm before it: when a backward pass has accumulated a gradient
(a post-accumulate-grad hook), it queues one autograd callback that runs when that backward pass ends, before
control returns to the training loop, and computes the total norm of every gradient then (launched and left on the
device: no synchronisation). With gradient accumulation each backward pass computes it again, and the last one
before the step is what clipping saw. The value is read with the step's other logged scalars. Cost: one pass over
the gradients per backward pass of a recorded step, like one extra ``clip_grad_norm_`` without the rescaling. The
norm as the step saw it costs nothing more at a lean statistics step: it is the root of the gradients' sums of
squares those statistics take anyway (``device_stats.LeanStep.grad_norm``).
"""
from __future__ import annotations

import math
import operator
import weakref
from collections import defaultdict

import torch

from .snapshots import SPARSE_LAYOUTS


# Gradients of up to this many elements are copied into one float64 buffer and reduced with one norm: a norm per
# small tensor costs its dispatch (4 us each on CPU, _foreach_norm included), a copy a third of that.
SMALL_LIMIT = 4096


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of all `tensors` taken together (a 0-d float32 tensor on the first tensor's device, computed
    without waiting for the device), None for no tensors. Sparse tensors count their stored values; complex ones
    the modulus of each element (torch.linalg.vector_norm's definition)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        t = t.detach()
        if t.layout in SPARSE_LAYOUTS:
            t = t.coalesce().values() if t.layout == torch.sparse_coo else t.values()
        if t.numel():
            by_device[t.device].append(t)
    if not by_device:
        return None if not tensors else torch.zeros((), device=tensors[0].device)
    parts = []
    for group in by_device.values():
        norms = torch._foreach_norm(group)
        parts.append(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])))
    target = parts[0].device
    if len(parts) == 1:
        return parts[0]
    return torch.linalg.vector_norm(torch.stack([p.to(target, non_blocking=True) for p in parts]))


class TotalNorm:
    """``total_norm`` for the same gradients step after step, cheaper where most of them are small: the small ones
    are copied into one float64 buffer kept between calls and reduced with one norm, the large ones with one norm
    each. Tensors it cannot batch (sparse, complex, split over devices) go to ``total_norm``."""

    def __init__(self):
        self._key = None

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        key = [(t.shape, t.dtype, t.layout) for t in tensors]  # a device change only makes the copy slower
        if key != self._key:
            self._plan(tensors, key)
        if self._fallback:
            return total_norm(tensors)
        with torch.no_grad():
            parts = []
            if self._small:
                torch._foreach_copy_(self._views, [tensors[i] for i in self._small])
                parts.append(torch.linalg.vector_norm(self._buffer))
            if self._large:
                norms = torch._foreach_norm([tensors[i] for i in self._large])
                parts.append(torch.linalg.vector_norm(torch.stack(norms), dtype=torch.float64))
            norm = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
            return norm.float()

    def _plan(self, tensors: list[torch.Tensor], key: list) -> None:
        self._key = key
        self._fallback = not tensors or len({t.device for t in tensors}) > 1 or any(
            t.layout in SPARSE_LAYOUTS or not t.is_floating_point() for t in tensors)
        self._small, self._large, self._views = [], [], []
        if self._fallback:
            return
        self._small = [i for i, t in enumerate(tensors) if t.numel() <= SMALL_LIMIT]
        self._large = [i for i, t in enumerate(tensors) if t.numel() > SMALL_LIMIT]
        self._buffer = torch.zeros(sum(tensors[i].numel() for i in self._small), dtype=torch.float64,
                                   device=tensors[0].device)
        at = 0
        for i in self._small:
            n = tensors[i].numel()
            self._views.append(self._buffer[at:at + n].view(tensors[i].shape))
            at += n


# Recorded steps whose gradients the step found as the backward pass left them, by their version counters and by
# both norms, before the backward pass's norm is taken to be the step's (BackwardNorm).
TRUST_AFTER = 16
# Two norms of the same gradients, taken by different reductions, differ in the last bits; a write that changes
# them (clipping, a rescaling, a clamp) changes the norm by more.
SAME_NORM_RTOL = 1e-5
_VERSION = operator.attrgetter("_version")  # a tensor's version counter: every in-place write moves it
# What BackwardNorm.at_step says of the norm it hands the step.
MEASURED, SAME_AS_STEP, MEASURED_UNCHANGED = "measured", "same as the step's", "measured, gradients unchanged"


class BackwardNorm:
    """One optimizer's total gradient norm at the end of each backward pass, measured while it could differ from the
    norm the step sees (module docstring). ``ended(grads)`` at each backward pass's end; ``at_step(grads)`` in the
    step's pre-hook says what the step gets: a measured norm, the step's own, or none."""

    def __init__(self):
        self._total = TotalNorm()  # the buffer a measured norm reuses
        self._norm: torch.Tensor | None = None  # measured at the last backward pass's end
        # (weak references to the gradients, their versions) at the last backward pass's end: weak, so that a
        # gradient dropped before the step (zero_grad after a skipped step) is freed, not held until the next one
        self._seen: tuple | None = None
        self._trusted = 0  # recorded steps that found the gradients unchanged and both norms equal
        self._changed = False  # a step found them changed once: measured at every backward pass since

    def measuring(self) -> bool:
        return self._changed or self._trusted < TRUST_AFTER

    def ended(self, grads: list[torch.Tensor]) -> None:
        """A backward pass ended, leaving `grads` (the optimizer's, in its order) for the next step."""
        self._seen = (list(map(weakref.ref, grads)), list(map(_VERSION, grads)))
        if self.measuring():
            self._norm = self._total(grads)

    def at_step(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor | None, str | None]:
        """(the norm measured when the last backward pass ended, or None; how it relates to the step's: MEASURED,
        SAME_AS_STEP (not measured: the step's own norm is the backward pass's), MEASURED_UNCHANGED (to be compared
        with the step's, ``compared``), or None (unknown: not measured, and the gradients changed)). Forgets both:
        the references are not kept past the step's pre-hook."""
        norm, seen = self._norm, self._seen
        self._norm = self._seen = None
        if seen is None:
            return norm, MEASURED if norm is not None else None
        unchanged = len(seen[0]) == len(grads) and all(map(operator.is_, [ref() for ref in seen[0]], grads)) and \
            seen[1] == list(map(_VERSION, grads))
        if not unchanged:
            self._changed = True
            return norm, MEASURED if norm is not None else None
        if norm is None:
            return None, SAME_AS_STEP
        return norm, MEASURED_UNCHANGED if not self._changed else MEASURED

    def forget(self) -> None:
        """A step that takes no norm: the gradients are not held past it."""
        self._norm = self._seen = None

    def compared(self, backward: float, step: float) -> None:
        """Both norms of a step whose gradients the version counters say unchanged: equal, they count toward
        trusting the counters; unequal (a write the counters miss), the norm is measured at every pass from now."""
        if math.isclose(backward, step, rel_tol=SAME_NORM_RTOL) or (math.isnan(backward) and math.isnan(step)):
            self._trusted += 1
        else:
            self._changed = True


def queue_after_backward(callback) -> bool:
    """Run `callback()` when the backward pass in progress ends (called from an autograd hook). False when autograd
    cannot take a callback here (no backward pass in progress on this thread)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        return False
    return True
