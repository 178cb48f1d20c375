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


def queue_after_backward(callback) -> bool:
    """Run `callback()` when the backward pass in progress ends (called from an autograd hook). False when autograd
    cannot take a callback here (no backward pass in progress on this thread)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        return False
    return True
