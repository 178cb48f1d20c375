"""Registry of wrappers and parallelisms: everything torch-upd knows about one kind of wrapper, in one module.

A training job rarely hands the recorder a bare ``nn.Module`` and ``torch.optim.Optimizer``: DDP and torch.compile
wrap the model, Accelerate and Lightning wrap the optimizer, FSDP2 shards the parameters into DTensors, a
ZeroRedundancyOptimizer or DeepSpeed steps a partition per rank. Each kind is one module in
``upd/recorder/wrappers/`` (auto-registered on import, like ``upd/replay/rules/``) defining a ``Wrapper`` subclass
that answers, for its kind only:

- ``model_inside(model)``: the module a model wrapper runs (its names carry no prefix of the wrapper's), else None;
- ``optimizer_inside(obj)``: what an optimizer wrapper may wrap, the candidates in order (none: not a wrapper);
- ``is_job_optimizer(obj)``: `obj` is an optimizer of the whole job that steps through a local one (ZeRO): looking
  through it stops there, because the rank setup must see it;
- ``job_optimizer_of(optimizer)``: the job optimizer that steps through the ``torch.optim.Optimizer`` given (a
  DeepSpeed engine's ZeRO optimizer for the client optimizer the user built), else None;
- ``local_optimizer(optimizer, model)``: the ``torch.optim.Optimizer`` whose step hooks the recorder uses on this
  rank (ZeRO's local ``.optim``; DeepSpeed's partition view), else None;
- ``job_parameters(optimizer)``: the job's logical parameters by param group (an object with ``param_groups``)
  when the job optimizer's own ``param_groups`` hold something else (DeepSpeed's flat partitions), else None;
- ``in_job(models, optimizers)`` / ``splits(...)``: this parallelism is in use / each rank holds only a part
  (`models`: the model as given and each module inside its wrappers, ``model_chain``);
- ``global_names(optimizer)``: names of the local optimizer's parameters that its own places would get wrong;
- ``local_part(tensor)`` / ``shard_layout(tensor, what)``: a rank's part of a distributed tensor, and where that
  part sits in the whole (a ``ShardLayout`` with its ``part_layout``: how readers stitch the parts, see
  ``upd.runfile.schema.PART_LAYOUTS``);
- ``counts_toward_whole(tensor, rank)``: whether this rank's statistics of `tensor` are added into the whole.

A method a kind does not override answers "not mine" (None, False, (), {}). The query functions below ask every
registered wrapper in ``priority`` order (highest first) and take the first answer: adding a wrapper is one module.
Ask them through ``upd.recorder.wrappers``, whose import registers every module. docs/distributed.md ("Adding a
wrapper") walks through one.
"""
from __future__ import annotations

import sys

import torch

from ..runfile import schema
from ..runfile.record import ShardLayout


def loaded_class(module: str, name: str):
    """A class of an optional module when that module is already imported, else None: nothing can be an instance
    of it then, and importing it (torch.distributed, deepspeed) would cost every single-process run."""
    return getattr(sys.modules.get(module), name, None)


def is_instance(value, cls) -> bool:
    return cls is not None and isinstance(value, cls)


def attribute(obj, name: str):
    """``getattr(obj, name, None)`` that survives whatever a property of someone else's wrapper raises."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


class Wrapper:
    """One kind of wrapper or parallelism. Subclass it in a module of ``upd/recorder/wrappers/`` and decorate the
    subclass with ``@register``; override only what the kind does (module docstring)."""

    name = "?"  # what users call it, for messages
    priority = 0  # asked before wrappers of lower priority (a DTensor parameter under DDP is FSDP's)
    parallelism: str | None = None  # the job's "parallelism" in the run's metadata (schema.PARALLELISMS)
    # What this rank's recorded tensors are, for the run's metadata: e.g. DeepSpeed's fp32 master partitions.
    recorded_weights: str | None = None

    def model_inside(self, model):
        return None

    def optimizer_inside(self, obj) -> tuple:
        return ()

    def is_job_optimizer(self, obj) -> bool:
        return False

    def job_optimizer_of(self, optimizer):
        return None

    def local_optimizer(self, optimizer, model):
        return None

    def job_parameters(self, optimizer):
        return None

    def in_job(self, models, optimizers) -> bool:
        return False

    def splits(self, models, optimizers) -> bool:
        return False

    def global_names(self, optimizer) -> dict[int, str]:
        return {}

    def local_part(self, tensor):
        return None

    def shard_layout(self, tensor, what: str) -> ShardLayout | None:
        return None

    def counts_toward_whole(self, tensor, rank: int) -> bool | None:
        return None


_WRAPPERS: list[Wrapper] = []  # highest priority first; filled by importing upd.recorder.wrappers


def register(cls: type[Wrapper]) -> type[Wrapper]:
    """Class decorator: register one instance of a Wrapper subclass (replacing an earlier one of the same name)."""
    if not (isinstance(cls, type) and issubclass(cls, Wrapper)):
        raise TypeError("@register decorates a subclass of upd.recorder.wrapper_registry.Wrapper")
    _WRAPPERS[:] = [w for w in _WRAPPERS if w.name != cls.name] + [cls()]
    _WRAPPERS.sort(key=lambda w: -w.priority)
    _local_part_hooks[:] = [w for w in _WRAPPERS if type(w).local_part is not Wrapper.local_part]
    return cls


def unregister(name: str) -> None:
    """Remove the wrapper registered under `name` (a test's own wrapper, once the test is done)."""
    _WRAPPERS[:] = [w for w in _WRAPPERS if w.name != name]
    _local_part_hooks[:] = [w for w in _local_part_hooks if w.name != name]


def wrappers() -> list[Wrapper]:
    """The registered wrappers, highest priority first."""
    return _WRAPPERS


def _first(method: str, *args):
    for wrapper in wrappers():
        found = getattr(wrapper, method)(*args)
        if found is not None:
            return found
    return None


# -- the queries the recorder, the launcher and the snapshots use ----------------------------------------------------
def model_chain(model, through_parallelisms: bool = True) -> list:
    """`model` and each module inside its wrappers, outermost first (empty for None): what ``in_job`` and
    ``splits`` look at, since a DDP wrapper may sit inside torch.compile's or the other way round. Without
    `through_parallelisms`, the chain stops at a wrapper of a parallelism (DDP, DeepSpeed's engine)."""
    chain, seen = [], set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        chain.append(model)
        inner = None
        for wrapper in wrappers():
            inner = wrapper.model_inside(model)
            if inner is not None:
                if wrapper.parallelism is not None and not through_parallelisms:
                    return chain
                break
        model = inner
    return chain


def model_inside(model, through_parallelisms: bool = True):
    """`model` without the wrappers that only run it (DDP, torch.compile, DataParallel, DeepSpeed's engine...): the
    module whose ``named_parameters()`` give the run's names. Without `through_parallelisms`, the module inside
    those of them that are no parallelism (DataParallel, Fabric, torch.compile), which the recorder must see."""
    chain = model_chain(model, through_parallelisms)
    return chain[-1] if chain else None


def is_job_optimizer(obj) -> bool:
    return any(w.is_job_optimizer(obj) for w in wrappers())


def optimizer_inside(obj, _seen: set | None = None):
    """The optimizer `obj` stands for: looked through optimizer wrappers (wrappers of wrappers too) down to a
    ``torch.optim.Optimizer`` that wraps no other (the one whose ``step()`` does the math and whose step hooks
    fire), stopping at a job optimizer (``is_job_optimizer``: the rank setup needs it whole). `obj` itself when it
    wraps none."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or is_job_optimizer(obj):
        return obj
    seen.add(id(obj))
    for wrapper in wrappers():
        for inner in wrapper.optimizer_inside(obj):
            found = optimizer_inside(inner, seen)
            if isinstance(found, torch.optim.Optimizer) or is_job_optimizer(found):
                return found
    return obj


def job_optimizer(optimizer):
    """The job optimizer that steps through `optimizer`, else `optimizer` itself."""
    found = _first("job_optimizer_of", optimizer)
    return optimizer if found is None else found


def job_parameters(optimizer):
    """What holds the job's logical parameters of a job optimizer by param group: `optimizer` itself unless its
    kind says otherwise."""
    found = _first("job_parameters", optimizer)
    return optimizer if found is None else found


def local_optimizer(optimizer, model):
    """The optimizer the recorder hooks on this rank for the job optimizer `optimizer` (`model` unwrapped)."""
    found = _first("local_optimizer", optimizer, model)
    return optimizer if found is None else found


def in_use(models, optimizers) -> list[Wrapper]:
    """The parallelisms in use, highest priority first (the last is always the plain one: replicated)."""
    return [w for w in wrappers() if w.parallelism is not None and w.in_job(models, optimizers)]


def splits(models, optimizers) -> bool:
    """Whether each rank holds or steps only a part of the model (then every rank records, for the whole)."""
    return any(w.splits(models, optimizers) for w in wrappers())


def global_names(optimizer) -> dict[int, str]:
    """id(parameter) -> name for the parameters of a local optimizer whose own places would misname them."""
    names = {}
    for wrapper in wrappers():
        names.update(wrapper.global_names(optimizer))
    return names


_local_part_hooks: list[Wrapper] = []  # the wrappers that override local_part: asked per tensor, so kept apart


def local_part(tensor):
    """This rank's part of a distributed tensor (a view, no copy, no communication); any other tensor (or None) as
    it is. Called for every tensor the recorder reads: one check per kind that has parts (FSDP2's DTensor)."""
    for wrapper in _local_part_hooks:
        part = wrapper.local_part(tensor)
        if part is not None:
            return part
    return tensor


def shard_layout(tensor, what: str) -> ShardLayout | None:
    """Where this rank's part `tensor` of a distributed parameter sits in the whole one, or None (a whole tensor).
    TypeError when it is a part whose place cannot be said: recording stops there."""
    return _first("shard_layout", tensor, what)


def counts_toward_whole(tensor, rank: int, parallelism_name: str) -> bool:
    """Whether this rank's statistics of `tensor` are added into the job's whole parameter (every element once):
    the kind that owns the tensor says; a tensor of no kind's (a copy on every rank) counts on rank 0, or on the
    one rank that steps it under a partitioning optimizer."""
    found = _first("counts_toward_whole", tensor, rank)
    if found is not None:
        return found
    return parallelism_name in schema.PARTITIONED or rank == 0
