"""Copies of what the optimizer is about to change, taken inside its step: the tensors as the run stores them.

A snapshot must not alias memory the optimizer updates in place, and must have a layout the file can hold: dense,
on the CPU, with a fixed shape. Of a distributed tensor (a DTensor under FSDP2, a flat partition) a rank stores its
local part, with a ``ShardLayout`` saying where that part sits in the whole tensor: gathering the whole would put a
collective inside the optimizer's step. Which part that is, and where it sits, each kind of wrapper says
(``wrapper_registry.local_part``, ``shard_layout``).
"""
from __future__ import annotations

import operator

import torch

from ..runfile import encoding
from .wrappers import local_part, shard_layout  # noqa: F401  (the recorder's names for them)
from .wrappers.fsdp2 import dtensor_class, placements_text

# torch's sparse layouts: tensors stored as indices and values (nn.Embedding(sparse=True) gradients), dense-copied
# where the recorder needs every element.
SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse gradient, parameter or state tensor as the dense tensor the run stores (no copy when dense)."""
    return tensor.to_dense() if tensor.layout in SPARSE_LAYOUTS else tensor


_COPIES_IN_FLIGHT = []  # CUDA devices with non_blocking copies to the host not yet waited for


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that cannot alias memory the optimizer updates in place. From a CUDA device: a non_blocking copy
    into pinned memory (torch's caching host allocator reuses it from step to step), ordered on the device's stream
    before the optimizer's kernels; ``wait_for_copies()`` once per step, before anything on the host reads it."""
    tensor = dense(local_part(tensor.detach()))
    if tensor.device.type == "cuda":
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        if tensor.device not in _COPIES_IN_FLIGHT:
            _COPIES_IN_FLIGHT.append(tensor.device)
        return out
    return tensor.to("cpu", copy=True)  # copy=True always copies


def wait_for_copies() -> None:
    """Wait until every cpu_copy made so far has landed: one synchronisation per device with copies in flight."""
    while _COPIES_IN_FLIGHT:
        torch.cuda.synchronize(_COPIES_IN_FLIGHT.pop())


def state_snapshot(state: dict) -> dict:
    """An optimizer's per-parameter state as CPU tensors: tensors copied, Python scalars as 0-d float64."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[str(key)] = cpu_copy(value)
        elif isinstance(value, (bool, int, float)):
            out[str(key)] = torch.tensor(float(value), dtype=torch.float64)
        # Other state (LBFGS's lists of history tensors, None buffers) has no fixed tensor shape to store.
    return out


def hparams_snapshot(group: dict) -> dict:
    """A param group's hyperparameters as JSON-able values (everything but the parameters themselves). Taken at
    every recorded step: the plain values most of them are pass as they are."""
    return {k: v if type(v) in _PLAIN else encoding.jsonable(v) for k, v in group.items() if k not in _NOT_HPARAMS}


_PLAIN = (float, int, bool, str, type(None))
_NOT_HPARAMS = ("params", "param_names")


def _immutable(value) -> bool:
    return type(value) in _PLAIN or (type(value) is tuple and all(type(v) in _PLAIN for v in value))


class HparamsSnapshots:
    """``hparams_snapshot`` of every param group of one optimizer, step after step. A group whose hyperparameters are
    the very values they were at the last call, all of them immutable (numbers, strings, tuples of them: not a tensor
    a scheduler fills in place), gets the same snapshot again, which nobody changes: taking one costs a recorded step
    on a small model more than its statistics' bookkeeping."""

    def __init__(self):
        # per group: (the group's size, a getter of its hyperparameters, their values, their snapshot), when immutable
        self._last: list[tuple | None] = []

    def __call__(self, groups: list[dict]) -> list[dict]:
        if len(self._last) != len(groups):
            self._last = [None] * len(groups)
        return [self._snapshot(i, group) for i, group in enumerate(groups)]

    def _snapshot(self, i: int, group: dict) -> dict:
        last = self._last[i]
        if last is not None and len(group) == last[0]:
            try:
                if last[1](group) == last[2]:  # a tuple of numbers, strings and tuples of them: no tensor compared
                    return last[3]
            except KeyError:  # a hyperparameter removed, another added
                pass
        snapshot = hparams_snapshot(group)
        keys = [k for k in group if k not in _NOT_HPARAMS]
        self._last[i] = None
        if keys and all(_immutable(group[k]) for k in keys):
            getter = operator.itemgetter(*keys)
            self._last[i] = (len(group), getter, getter(group), snapshot)
        return snapshot


def refuse_unlike_param(tensor, param, what: str) -> None:
    """Stop at a DTensor gradient or optimizer state that is not laid out like its parameter: the run stores it as
    the local part at the parameter's offset, which would then be the wrong piece (or a Partial summand)."""
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(tensor, dtensor):
        return
    if not isinstance(param, dtensor):
        raise TypeError(f"{what} is a DTensor (torch.distributed.tensor, placements [{placements_text(tensor)}]) of a "
                        "parameter that is not one; torch-upd cannot say which part of it this rank holds")
    if (tensor.placements, tensor.shape, tensor.device_mesh) != (param.placements, param.shape, param.device_mesh):
        raise TypeError(f"{what} is a DTensor laid out unlike its parameter (shape {list(tensor.shape)}, placements "
                        f"[{placements_text(tensor)}]; the parameter: {list(param.shape)}, [{placements_text(param)}]); "
                        "torch-upd stores a gradient or state as the part at the parameter's offset")
