"""Logged scalars (``rec.log(loss=...)``): what a value may be, and bringing many of them to the host at once.

A loss is usually a 0-d tensor on the training device; reading it (``float(loss)``) waits for the device to finish
the step. The recorder instead keeps the tensor (detached) and reads the values in one copy per device when a full
record is written (its tensor copies have synchronised the device by then, so the read waits for nothing), or
every ``HOST_BATCH_STEPS`` steps without one: a statistics step has its one host copy already, and the values wait.
"""
from __future__ import annotations

import numbers
from collections import defaultdict

import torch

from ..runfile import schema

# Steps whose logged values may wait on the device before they are read and written without a record: bounds what
# a crash loses and how many tiny tensors stay alive.
HOST_BATCH_STEPS = 64


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a logged scalar's name, or None."""
    if not name:
        return "an empty name"
    if name in schema.RESERVED_SCALAR_NAMES or name.startswith(schema.RESERVED_SCALAR_PREFIX):
        return (f"a column of run.steps() ({', '.join(schema.RESERVED_SCALAR_NAMES)}, "
                f"{schema.RESERVED_SCALAR_PREFIX}<g>)")
    if name in schema.RECORDER_SCALARS:
        return "a name the recorder logs itself"
    return None


def scalar_problem(value) -> str | None:
    """Why `value` cannot be logged as one number, or None. Looks at a tensor's metadata only (no device sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"a tensor of shape {tuple(value.shape)} (one number is logged: pass a 1-element tensor)"
        if value.is_complex():
            return "a complex tensor"
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"a {type(value).__name__} (log numbers or 1-element tensors)"
    return None



def check_logged(scalars: dict) -> None:
    """``rec.log(**scalars)``'s values: ValueError for a name that cannot be logged, TypeError for a value."""
    for name, value in scalars.items():
        problem = name_problem(name)
        if problem:
            raise ValueError(f"rec.log: {name!r} is {problem}; choose another name")
        problem = scalar_problem(value)
        if problem:
            raise TypeError(f"rec.log: {name}= is {problem}")


def kept(value):
    """The value as the recorder keeps it until it is read: a tensor detached (its graph freed), on its device."""
    return value.detach().reshape(()) if isinstance(value, torch.Tensor) else float(value)


def to_host(rows: list) -> list:
    """Rows (step, wall_time, {name: number or tensor}) with every value a float: one copy per device for all the
    tensors of all the rows."""
    by_device: dict[torch.device, list] = defaultdict(list)
    for i, (_, _, values) in enumerate(rows):
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                by_device[value.device].append((i, name, value))
    out = [(step, wall_time, dict(values)) for step, wall_time, values in rows]
    for device, items in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        host = torch.stack([value.to(dtype) for _, _, value in items]).cpu().tolist()
        for (i, name, _), number in zip(items, host):
            out[i][2][name] = float(number)
    return out
