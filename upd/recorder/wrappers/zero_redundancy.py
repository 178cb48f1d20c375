"""torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1): each rank's local optimizer (``.optim``) steps a
partition of whole parameters; the wrapper broadcasts the results. Every rank records its partition; a parameter is
held whole by the one rank that steps it."""
from __future__ import annotations

import torch

from ...runfile import schema
from ..wrapper_registry import Wrapper, is_instance, loaded_class, register


def zero_class():
    return loaded_class("torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer")


@register
class ZeroRedundancy(Wrapper):
    name = "ZeroRedundancyOptimizer"
    priority = 30
    parallelism = schema.ZERO

    def is_job_optimizer(self, obj) -> bool:
        return is_instance(obj, zero_class())

    def local_optimizer(self, optimizer, model):
        if not is_instance(optimizer, zero_class()):
            return None
        local = getattr(optimizer, "optim", None)
        if not isinstance(local, torch.optim.Optimizer):
            # overlap_with_ddp=True builds a functional local optimizer later, inside DDP's communication hook: it
            # has no step hooks to attach to.
            raise TypeError("a ZeroRedundancyOptimizer with overlap_with_ddp=True cannot be recorded (its local "
                            "optimizer is functional and steps inside DDP's communication hook)")
        return local

    def in_job(self, models, optimizers) -> bool:
        return any(is_instance(opt, zero_class()) for opt in optimizers)

    splits = in_job

    def global_names(self, optimizer) -> dict[int, str]:
        """Names by the parameter's place in the optimizer the user built: the local optimizer holds only this
        rank's partition, so its own places would give one name to different parameters on different ranks."""
        if not is_instance(optimizer, zero_class()):
            return {}
        names = {}
        for g, group in enumerate(optimizer.param_groups):
            given = group.get("param_names") or []
            for i, p in enumerate(group["params"]):
                names[id(p)] = given[i] if i < len(given) else f"group{g}.param{i}"
        return names
