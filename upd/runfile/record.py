"""The writer's input: one optimizer step as the run file stores it, and nothing else.

The recorder builds these and hands them over (``RunWriter.write``, ``AsyncRunWriter.write``); what it needs only
while a step is in progress (which parameters it chose, statistics launched before the step, the live parameters)
stays inside the recorder. Every field here ends up in the file.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .encoding import dtype_name


@dataclass
class ParamSnapshot:
    """What one parameter looked like to the optimizer at one record (CPU copies)."""

    name: str
    group: int
    index_in_group: int
    param: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict = field(default_factory=dict)  # key -> CPU tensor (0-d for scalars)
    param_after: torch.Tensor | None = None


def param_meta(snap: ParamSnapshot, like: torch.Tensor | None) -> dict:
    """The metadata the file keeps of a parameter (its group's ``meta`` attribute, the statistics table's
    ``param_meta``): its name and place in the optimizer, and the shape and dtype of `like` (the parameter)."""
    return {"name": snap.name, "group": snap.group, "index_in_group": snap.index_in_group,
            "shape": list(like.shape) if like is not None else None,
            "dtype": dtype_name(like.dtype) if like is not None else None}


@dataclass
class Record:
    """One optimizer step: its full tensors (``full``), its summary statistics (``stats``), or both."""

    optimizer: int
    step: int
    backward_pass: int
    wall_time: float
    hparams: list  # one JSON-able dict per param group
    params: list[ParamSnapshot]
    closure_losses: list | None = None  # step(closure): the loss of each closure evaluation, in order; else None
    full: bool = True  # the full tensors of `params` are written (a statistics-only record ignores them)
    stats: dict | None = None  # per-parameter summary statistics {name: {column: value}} at a statistics step
    stats_meta: dict = field(default_factory=dict)  # {name: {shape, dtype, group, index_in_group}} of those params
