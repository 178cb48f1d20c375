"""DeepSpeed ZeRO stages 1, 2 and 3 (``deepspeed.initialize``): the engine runs the model (names without its
``module.`` prefix); its ZeRO optimizer hands the client ``torch.optim.Optimizer`` this rank's partition of fp32
master weights as one flat tensor per param group (ZeRO-3: per sub-group). Each rank records the fp32 master
weights the optimizer steps, through a ``PartitionView``: one fragment per model parameter that has elements in
this rank's partition, a run of its flattened elements (part layout "flat"), mapped back with the engine's own
mapping (``param._hp_mapping`` under ZeRO-1/2, the same one ``deepspeed.utils.safe_get_local_fp32_param`` reads;
``param.ds_tensor`` under ZeRO-3). Readers stitch the runs into the whole parameter.

What the optimizer saw besides: DeepSpeed clips and unscales the flat gradient inside its step, so the recorded
gradient is the one the optimizer stepped with (after clipping); the step's pre-clip global gradient norm, the loss
scale and the clipping threshold are stored with the step's hyperparameters (``deepspeed_grad_norm``,
``deepspeed_loss_scale``, ``deepspeed_gradient_clipping``). What is not supported (optimizer or parameter offload,
NVMe included; model or expert parallelism; ZenFlow; an optimizer that is not a torch.optim.Optimizer) stops
recording with one RecorderWarning naming it.
"""
from __future__ import annotations

import gc
import sys
import warnings

import torch
import torch.distributed as dist

from ...runfile import schema
from ..naming import named_parameters
from ..partition_view import Fragment, PartitionView, partition_view
from ..wrapper_registry import Wrapper, attribute, is_instance, loaded_class, register

RECORDED_WEIGHTS = ("fp32 master weights: each rank's partition of DeepSpeed's fp32 copy, the tensors its optimizer "
                    "steps; update:data ratios are of these (the model's bf16/fp16 weights, where DeepSpeed keeps "
                    "them, are copies rounded from them)")


def zero_classes() -> tuple:
    return tuple(c for c in (
        loaded_class("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
        loaded_class("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")) if c is not None)


def is_zero(obj) -> bool:
    classes = zero_classes()
    return bool(classes) and isinstance(obj, classes)


def is_stage3(obj) -> bool:
    return is_instance(obj, loaded_class("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"))


def engine_class():
    return loaded_class("deepspeed.runtime.engine", "DeepSpeedEngine")


class JobParameters:
    """The job's logical parameters of a ZeRO optimizer, by the client optimizer's param groups (the model's
    parameters; the optimizer's own ``param_groups`` hold this rank's flat partitions)."""

    def __init__(self, groups: list[list]):
        self.param_groups = [{"params": params} for params in groups]


def _unsupported(zero) -> str | None:
    """What this ZeRO optimizer does that torch-upd cannot record, or None."""
    if not isinstance(zero.optimizer, torch.optim.Optimizer):
        return f"its optimizer {type(zero.optimizer).__name__} is not a torch.optim.Optimizer"
    for flag, what in (("cpu_offload", "optimizer offload (offload_optimizer)"),
                       ("offload_optimizer", "optimizer offload (offload_optimizer, CPU or NVMe)"),
                       ("offload_param", "parameter offload (offload_param, CPU or NVMe)"),
                       ("zenflow", "ZenFlow"), ("has_moe_layers", "mixture-of-experts layers (expert parallelism)"),
                       ("use_muon", "its Muon optimizer path")):
        if attribute(zero, flag):
            return what
    if attribute(zero, "torch_autocast_gradscaler") is not None:
        return "torch autocast with a GradScaler"
    group = attribute(zero, "dp_process_group")
    if dist.is_initialized() and group is not None and dist.get_world_size(group) != dist.get_world_size():
        return ("a data-parallel group smaller than the job (model, pipeline or sequence parallelism): a rank's "
                "partition is not a part of the whole job's parameters")
    return None


def _names(model, params) -> dict[int, str]:
    names = {} if model is None else {id(p): n for n, p in named_parameters(model)}
    return {id(p): names.get(id(p), f"group{g}.param{i}") for g, group in enumerate(params) for i, p in enumerate(group)}


def _view_stage12(zero, model) -> PartitionView:
    names = _names(model, zero.bit16_groups)
    fragments = []
    for i, params in enumerate(zero.bit16_groups):
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue  # none of this parameter's elements are in this rank's partition
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            fragments.append(Fragment(name=names[id(p)], group=i, flat=i, start=int(hp.start), count=int(hp.numel),
                                      offset=int(lp.start), shape=tuple(p.shape)))
    return partition_view(zero.optimizer, zero.single_partition_of_fp32_groups, _groups_stage12(zero), fragments,
                          _world(zero), lambda: _step_facts(zero), job_names=list(names.values()))


def _groups_stage12(zero) -> list[dict]:
    """The optimizer's param group dicts, group i holding flat partition i. ZeRO-1/2 step the optimizer once per
    group with its ``param_groups`` set to that group alone (``DeepSpeedZeroOptimizer._optimizer_step``), and ``upd
    record`` attaches at the first step, inside that window: there the whole list is the one that call keeps to put
    back (its ``original_param_groups``). TypeError (recording stops, one RecorderWarning) when it is not found."""
    flats = zero.single_partition_of_fp32_groups

    def whole(groups) -> bool:
        return (isinstance(groups, list) and len(groups) == len(flats)
                and all(isinstance(g, dict) and any(p is flat for p in g.get("params", ()))
                        for g, flat in zip(groups, flats)))

    if whole(zero.optimizer.param_groups):
        return list(zero.optimizer.param_groups)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("self") is zero and whole(frame.f_locals.get("original_param_groups")):
            return list(frame.f_locals["original_param_groups"])
        frame = frame.f_back
    raise TypeError(f"its optimizer shows {len(zero.optimizer.param_groups)} of its {len(flats)} param groups "
                    f"(inside DeepSpeed's step of one group) and the others were not found")


def _view_stage3(zero, model) -> PartitionView:
    rank = dist.get_rank(group=zero.dp_process_group) if dist.is_initialized() else 0
    by_group: dict[int, list] = {}
    for sub, params in enumerate(zero.fp16_groups):
        by_group.setdefault(int(zero.sub_group_to_group_id[sub]), []).extend(params)
    groups = list(zero.optimizer.param_groups)
    names = _names(model, [by_group.get(g, []) for g in range(len(groups))])
    fragments = []
    for sub, params in enumerate(zero.fp16_groups):
        start = 0
        for p in params:
            part = int(p.ds_tensor.ds_numel)  # every rank's partition of the parameter has this size (padded)
            first = rank * part
            count = max(0, min(part, int(p.ds_numel) - first))
            if count:
                fragments.append(Fragment(name=names[id(p)], group=int(zero.sub_group_to_group_id[sub]), flat=sub,
                                          start=start, count=count, offset=first, shape=tuple(p.ds_shape)))
            start += part
    return partition_view(zero.optimizer, zero.fp32_partitioned_groups_flat, groups, fragments, _world(zero),
                          lambda: _step_facts(zero), job_names=list(names.values()))


def _world(zero) -> int:
    return dist.get_world_size(group=zero.dp_process_group) if dist.is_initialized() else 1


def _number(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().float().item() if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) else None


def _step_facts(zero) -> dict:
    """What DeepSpeed did to this step's gradient before the optimizer saw it (stored with its hyperparameters)."""
    return {"deepspeed_grad_norm": _number(attribute(zero, "_global_grad_norm")),
            "deepspeed_loss_scale": _number(attribute(zero, "loss_scale")),
            "deepspeed_gradient_clipping": _number(attribute(zero, "clip_grad"))}


def _holder_of(optimizer, classes):
    """The live instance of `classes` whose ``optimizer`` is `optimizer`, or None: found among every object the
    garbage collector tracks. Looking at them all touches deprecated module attributes (torch.distributed's
    ``reduce_op`` warns a FutureWarning), so the scan runs with warnings off; a weak proxy whose object is gone
    (isinstance looks up its class) is skipped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, classes) and attribute(obj, "optimizer") is optimizer:
                    return obj
            except ReferenceError:
                continue
    return None


def _engine_of(zero):
    """The live DeepSpeed engine whose optimizer is `zero`, or None."""
    engine = engine_class()
    return None if engine is None else _holder_of(zero, engine)


@register
class DeepSpeed(Wrapper):
    name = "DeepSpeed"
    priority = 50
    parallelism = schema.DEEPSPEED
    recorded_weights = RECORDED_WEIGHTS

    def model_inside(self, model):
        return model.module if is_instance(model, engine_class()) else None

    def is_job_optimizer(self, obj) -> bool:
        return is_zero(obj)

    def job_optimizer_of(self, optimizer):
        """The ZeRO optimizer whose client optimizer is `optimizer` (the one the user built and passed to
        ``deepspeed.initialize``, or the one ``upd record`` saw step): found once, among the live objects."""
        classes = zero_classes()
        if not classes or not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, PartitionView):
            return None
        return _holder_of(optimizer, classes)

    def local_optimizer(self, optimizer, model):
        if not is_zero(optimizer):
            return None
        if model is None:  # `upd record`, which sees the client optimizer step: names from the engine's module
            engine = _engine_of(optimizer)
            model = None if engine is None else engine.module
        problem = _unsupported(optimizer)
        if problem is not None:
            raise TypeError(f"DeepSpeed ZeRO with {problem} cannot be recorded yet")
        return _view_stage3(optimizer, model) if is_stage3(optimizer) else _view_stage12(optimizer, model)

    def job_parameters(self, optimizer):
        if not is_zero(optimizer):
            return None
        if is_stage3(optimizer):
            groups: dict[int, list] = {}
            for sub, params in enumerate(optimizer.fp16_groups):
                groups.setdefault(int(optimizer.sub_group_to_group_id[sub]), []).extend(params)
            return JobParameters([groups.get(g, []) for g in range(len(optimizer.optimizer.param_groups))])
        return JobParameters([list(params) for params in optimizer.bit16_groups])

    def in_job(self, models, optimizers) -> bool:
        engine = engine_class()
        return any(is_zero(opt) for opt in optimizers) or any(is_instance(m, engine) for m in models)

    def splits(self, models, optimizers) -> bool:
        return any(is_zero(opt) for opt in optimizers)
