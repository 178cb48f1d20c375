"""The writer's input: one optimizer step as the run file stores it, and nothing else.

The recorder builds these and hands them over (``RunWriter.write``, ``AsyncRunWriter.write``); what it needs only
while a step is in progress (which parameters it chose, statistics launched before the step, the live parameters)
stays inside the recorder. Every field here ends up in the file.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch

from . import schema
from .encoding import dtype_name


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's part of a distributed parameter (a DTensor, a flat partition) sits in the whole tensor. Its field names are the
    metadata keys a sharded parameter's ``meta`` gains (docs/format.md, "Distributed jobs")."""

    global_shape: list  # the whole (logical) tensor's shape
    offset: list  # the global index of the local part's first element along each dimension
    placements: list  # repr() of each placement over the mesh dimensions, e.g. "Shard(dim=0)", "Replicate()"
    mesh_shape: list  # the device mesh's shape
    part_layout: str = schema.PART_BOX  # how the part sits in the whole: schema.PART_LAYOUTS


@dataclass
class ParamSnapshot:
    """What one parameter looked like to the optimizer at one record (CPU copies; of a DTensor, the local part)."""

    name: str
    group: int
    index_in_group: int
    param: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict = field(default_factory=dict)  # key -> CPU tensor (0-d for scalars)
    param_after: torch.Tensor | None = None
    shard: ShardLayout | None = None  # a DTensor parameter: where the stored local part sits in the whole tensor


def param_meta(snap: ParamSnapshot, like: torch.Tensor | None) -> dict:
    """The metadata the file keeps of a parameter (its group's ``meta`` attribute, the statistics table's
    ``param_meta``): its name and place in the optimizer, the shape and dtype of `like` (the parameter as stored:
    a DTensor's local part), and, for a DTensor, its ``ShardLayout``."""
    meta = {"name": snap.name, "group": snap.group, "index_in_group": snap.index_in_group,
            "shape": list(like.shape) if like is not None else None,
            "dtype": dtype_name(like.dtype) if like is not None else None}
    if snap.shard is not None:
        meta.update(asdict(snap.shard))
    return meta


def holds_part(meta: dict) -> bool:
    """Whether a parameter's stored tensors are a part of a larger tensor (a rank's shard of a DTensor): its
    metadata's global shape differs from its stored shape. A rank's whole copy (Replicate) is not a part."""
    global_shape = meta.get("global_shape")
    return global_shape is not None and list(global_shape) != list(meta.get("shape") or [])


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
    # per-parameter summary statistics {name: {column: value}} at a statistics step: a dict, or the lean set's table
    # (stats_table.StatsRows, a Mapping that reads the same)
    stats: Mapping | None = None
    stats_meta: dict = field(default_factory=dict)  # {name: {shape, dtype, group, index_in_group}} of those params
    # Logged scalars read to the host so far, for the scalars table: (step, wall_time, {name: float}) per step. A
    # record may carry only these (full=False, stats=None): steps that logged values but wrote nothing else.
    scalars: list = field(default_factory=list)
