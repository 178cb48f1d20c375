"""Copies of what the optimizer is about to change, taken inside its step: the tensors as the run stores them.

A snapshot must not alias memory the optimizer updates in place, and must have a layout the file can hold: dense,
on the CPU, with a fixed shape. Tensors the recorder cannot store faithfully (DTensor) stop recording here.
"""
from __future__ import annotations

import sys

import torch

from ..runfile import encoding
from .device_stats import SPARSE_LAYOUTS


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse gradient, parameter or state tensor as the dense tensor the run stores (no copy when dense)."""
    return tensor.to_dense() if tensor.layout in SPARSE_LAYOUTS else tensor


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    tensor = dense(tensor.detach())
    # .to(..., copy=True) always copies, so the snapshot cannot alias memory the optimizer updates in place.
    return tensor.to("cpu", copy=True)


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
    """A param group's hyperparameters as JSON-able values (everything but the parameters themselves)."""
    return {k: encoding.jsonable(v) for k, v in group.items() if k not in ("params", "param_names")}


def dtensor_class():
    """torch.distributed.tensor.DTensor when that module is loaded (no DTensor can exist otherwise), else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def refuse_dtensor(dtensor_class, tensor, what: str) -> None:
    """Stop recording at the first DTensor: its local shard is not the tensor the optimizer updates, and a gathered
    copy would be a collective inside the optimizer's step (distributed recording is not supported yet)."""
    if dtensor_class is not None and isinstance(tensor, dtensor_class):
        placements = ", ".join(str(pl) for pl in getattr(tensor, "placements", ()))
        raise TypeError(f"{what} is a DTensor (torch.distributed.tensor, placements [{placements}]); torch-upd "
                        "does not record distributed tensors yet")
