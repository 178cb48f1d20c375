"""A plain model and optimizer: every rank that runs one holds and steps the whole model (a copy per rank)."""
from __future__ import annotations

from ...runfile import schema
from ..wrapper_registry import Wrapper, register


@register
class Plain(Wrapper):
    name = "plain"
    priority = -100  # asked last: the answer when no other parallelism is in use
    parallelism = schema.REPLICATED

    def in_job(self, models, optimizers) -> bool:
        return True
