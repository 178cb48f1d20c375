"""The fragments of a ``PartitionView`` (DeepSpeed ZeRO, FSDP1's flat parameters): each is a run of a model
parameter's flattened elements inside a rank's flat partition, named after the parameter and tagged with where the
run sits in it (part layout "flat"). Exactly one rank holds each run, so every fragment counts toward the whole."""
from __future__ import annotations

from ..partition_view import PartitionView, fragment_layout
from ..wrapper_registry import Wrapper, register


@register
class FlatPartitions(Wrapper):
    name = "flat partitions (PartitionView)"
    priority = 60

    def global_names(self, optimizer) -> dict[int, str]:
        return optimizer.names if isinstance(optimizer, PartitionView) else {}

    def shard_layout(self, tensor, what: str):
        return fragment_layout(tensor)

    def counts_toward_whole(self, tensor, rank: int):
        return True if fragment_layout(tensor) is not None else None
