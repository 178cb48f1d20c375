"""torch.nn.parallel.DistributedDataParallel: a replica of the whole model on every rank, gradients all-reduced.
Its parameter names carry a ``module.`` prefix that is no part of the model's; rank 0 alone records by default."""
from __future__ import annotations

from ...runfile import schema
from ..wrapper_registry import Wrapper, is_instance, loaded_class, register


def ddp_class():
    return loaded_class("torch.nn.parallel.distributed", "DistributedDataParallel")


@register
class DDP(Wrapper):
    name = "DistributedDataParallel"
    priority = 10
    parallelism = schema.DDP

    def model_inside(self, model):
        return model.module if is_instance(model, ddp_class()) else None

    def in_job(self, models, optimizers) -> bool:
        cls = ddp_class()
        return any(is_instance(m, cls) for m in models)
