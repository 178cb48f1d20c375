"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): each FSDP unit concatenates its parameters into one
flat parameter and gives each rank a contiguous shard of it (padded at the end). A rank's part of a model parameter
is thus a run of its flattened elements (part layout "flat"), found in the flat parameter's own shard metadata
(``_shard_param_infos``, ``_shapes``, ``_fqns``).

- ``use_orig_params=False``: the optimizer steps the flat parameters; a ``PartitionView`` shows it as the model's
  parameters, one fragment per (parameter, flat shard) pair.
- ``use_orig_params=True``: the optimizer steps the model's own parameters, which FSDP keeps as 1-d views of this
  rank's shard between steps; each is tagged with where its run sits (the same ``ShardLayout`` as a fragment's).

Names are the model's, without FSDP's ``_fsdp_wrapped_module.`` components (``torch.distributed.fsdp``'s own
clean_tensor_name). NO_SHARD keeps a whole copy on every rank: recorded as replicated training.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...runfile import schema
from ...runfile.record import ShardLayout
from ..naming import without_compile_prefix
from ..partition_view import FRAGMENT_LAYOUT, Fragment, partition_view
from ..wrapper_registry import Wrapper, is_instance, loaded_class, register


def fsdp_class():
    return loaded_class("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name  # loaded with FSDP itself

    return without_compile_prefix(clean_tensor_name(name))


def _units(model) -> list:
    """(prefix, flat parameter) of every FSDP unit in `model` that has one, outermost first."""
    cls = fsdp_class()
    out = []
    for prefix, module in model.named_modules():
        if is_instance(module, cls):
            handle = getattr(module, "_handle", None)
            flat = getattr(handle, "flat_param", None)
            if flat is not None:
                out.append((prefix, flat))
    return out


def _sharded(models) -> bool:
    cls = fsdp_class()
    return any(is_instance(m, cls) and getattr(getattr(m, "_handle", None), "uses_sharded_strategy", False)
               for root in models[-1:] for m in root.modules())


class CleanNames:
    """An FSDP1 model as ``model=``: its parameters under the names of the model it wraps."""

    def __init__(self, model):
        self.model = model

    def named_parameters(self):
        for name, param in self.model.named_parameters():
            yield _clean(name), param

    def parameters(self):
        for _, param in self.named_parameters():
            yield param


def _runs(model):
    """(flat parameter, [(name, index in it, _ShardParamInfo, shape)]) of each FSDP unit of `model`."""
    for prefix, flat in _units(model):
        params = []
        for j, (fqn, info, shape) in enumerate(zip(flat._fqns, flat._shard_param_infos, flat._shapes)):
            params.append((_clean(f"{prefix}.{fqn}" if prefix else fqn), j, info, tuple(shape)))
        yield flat, params


@register
class FSDP1(Wrapper):
    name = "FullyShardedDataParallel (FSDP1)"
    priority = 35
    parallelism = schema.FSDP1

    def model_inside(self, model):
        cls = fsdp_class()
        return CleanNames(model) if is_instance(model, cls) else None

    def in_job(self, models, optimizers) -> bool:
        return any(is_instance(m, fsdp_class()) for m in models)

    def splits(self, models, optimizers) -> bool:
        return self.in_job(models, optimizers) and _sharded([m for m in models if is_instance(m, fsdp_class())])

    def local_optimizer(self, optimizer, model):
        if not isinstance(model, CleanNames) or not isinstance(optimizer, torch.optim.Optimizer):
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        units = list(_runs(model.model))
        if not any(id(flat) in held for flat, _ in units):
            # use_orig_params=True: the optimizer steps the model's parameters, 1-d views of this rank's shard.
            for flat, params in units:
                originals = getattr(flat, "_params", None) or []
                for (name, j, info, shape), param in zip(params, originals):
                    # Not in this rank's shard: an empty part, at offset 0 (readers ignore empty parts).
                    start = int(info.intra_param_start_idx) if info.in_shard else 0
                    setattr(param, FRAGMENT_LAYOUT, ShardLayout(
                        global_shape=list(shape), offset=[start], placements=[schema.PART_FLAT],
                        mesh_shape=[world], part_layout=schema.PART_FLAT))
            return None
        flats, fragments, job_names = [], [], []
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        for flat, params in units:
            if id(flat) not in held:
                continue
            flats.append(flat)
            for name, j, info, shape in params:
                job_names.append(name)  # the job's parameter, whichever ranks hold its elements
                if info.in_shard and info.numel_in_shard:
                    fragments.append(Fragment(name=name, group=group_of[id(flat)], flat=len(flats) - 1,
                                              start=int(info.offset_in_shard), count=int(info.numel_in_shard),
                                              offset=int(info.intra_param_start_idx), shape=shape))
        return partition_view(optimizer, flats, list(optimizer.param_groups), fragments, world, job_names=job_names)
