"""Total gradient norms: as the backward pass accumulated them, and as the optimizer step saw them.

Gradient clipping (``clip_grad_norm_``), GradScaler's unscaling or any other change between ``backward()`` and
``optimizer.step()`` rewrites the gradients in place, so the step pre-hook sees only their result. To say whether
clipping was active the recorder also needs the norm before it: when a backward pass has accumulated a gradient
(a post-accumulate-grad hook), it queues one autograd callback that runs when that backward pass ends, before
control returns to the training loop, and computes the total norm of every gradient then (one ``_foreach_norm``
per device, launched and left on the device: no synchronisation). With gradient accumulation each backward pass
computes it again, and the last one before the step is what clipping saw. The value is read with the step's
other logged scalars. Cost: one norm over the gradients per backward pass of a recorded step, like one extra
``clip_grad_norm_`` without the rescaling.
"""
from __future__ import annotations

from collections import defaultdict

import torch

SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


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


def queue_after_backward(callback) -> bool:
    """Run `callback()` when the backward pass in progress ends (called from an autograd hook). False when autograd
    cannot take a callback here (no backward pass in progress on this thread)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        return False
    return True
