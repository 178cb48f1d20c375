"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and any other DTensor parameters: each rank holds a box of each
tensor (``DTensor.to_local()``), recorded with a ``ShardLayout`` saying where it sits (part layout "box"). Gathering
the whole would put a collective inside the optimizer's step, so a rank stores its own part. A DTensor whose local
part is not a slice of the whole (a Partial placement: a summand; a strided shard) stops recording."""
from __future__ import annotations

import sys

from ...runfile import schema
from ...runfile.record import ShardLayout
from ..wrapper_registry import Wrapper, register

_DTENSOR = []  # DTensor, once its module is loaded: looked up per tensor and step, so cached


def dtensor_class():
    """torch.distributed.tensor.DTensor when that module is loaded (no DTensor can exist otherwise), else None."""
    if not _DTENSOR:
        found = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if found is None:
            return None
        _DTENSOR.append(found)
    return _DTENSOR[0]


def placements_text(tensor) -> str:
    return ", ".join(repr(pl) for pl in tensor.placements)


def _parameters(models, optimizers) -> list:
    params = list(models[-1].parameters()) if models else []
    return params + [p for opt in optimizers for g in opt.param_groups for p in g["params"]]


@register
class FSDP2(Wrapper):
    name = "FSDP2 (DTensor)"
    priority = 40
    parallelism = schema.FSDP

    def in_job(self, models, optimizers) -> bool:
        dtensor = dtensor_class()
        return dtensor is not None and any(isinstance(p, dtensor) for p in _parameters(models, optimizers))

    def splits(self, models, optimizers) -> bool:
        dtensor = dtensor_class()
        return dtensor is not None and any(isinstance(p, dtensor) and any(pl.is_shard() for pl in p.placements)
                                           for p in _parameters(models, optimizers))

    def local_part(self, tensor):
        if not _DTENSOR and dtensor_class() is None:
            return None
        return tensor.to_local() if isinstance(tensor, _DTENSOR[0]) else None

    def shard_layout(self, tensor, what: str) -> ShardLayout | None:
        """TypeError when the local part is not a slice of the whole: a Partial placement (every rank holds a
        summand), or a strided or custom shard."""
        dtensor = dtensor_class()
        if dtensor is None or not isinstance(tensor, dtensor):
            return None
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        placements = tuple(tensor.placements)
        # Exact types: _StridedShard (FSDP2 over tensor parallelism) holds interleaved pieces, not one slice.
        if not all(type(pl) in (Shard, Replicate) for pl in placements):
            raise TypeError(f"{what} is a DTensor (torch.distributed.tensor, placements [{placements_text(tensor)}]) "
                            "whose local part is not a slice of the whole tensor; torch-upd records Shard and "
                            "Replicate placements only")
        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
        if tuple(local_shape) != tuple(tensor.to_local().shape):
            raise TypeError(f"{what} is a DTensor whose local part has shape {tuple(tensor.to_local().shape)}, not "
                            f"the {tuple(local_shape)} its placements [{placements_text(tensor)}] give: torch-upd "
                            "cannot say where it sits in the whole tensor")
        return ShardLayout(global_shape=list(tensor.shape), offset=[int(o) for o in offset],
                           placements=[repr(pl) for pl in placements], mesh_shape=list(tensor.device_mesh.shape),
                           part_layout=schema.PART_BOX)

    def counts_toward_whole(self, tensor, rank: int) -> bool | None:
        """A DTensor's part counts on the ranks at coordinate 0 of every mesh dimension it is replicated along
        (HSDP keeps copies of each shard)."""
        dtensor = dtensor_class()
        if dtensor is None or not isinstance(tensor, dtensor):
            return None
        coordinate = tensor.device_mesh.get_coordinate()
        return coordinate is not None and all(c == 0 for c, placement in zip(coordinate, tensor.placements)
                                              if placement.is_replicate())
