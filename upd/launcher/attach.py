"""Starting a recording from outside the program, at an optimizer's first step: which optimizers, named after which
model, into which file.

``upd.record(path, model, optimizer)`` is told all three; ``upd record`` finds them. The optimizers are those the
process created and had not stepped yet (``global_hooks`` hands them over as one group), less those another
recorder already records and those that only run inside another one's step (the optimizer a wrapper or a
ZeroRedundancyOptimizer steps). The model is the module whose parameters cover the optimizer's: among every
``nn.Module`` alive that is no other module's child, the one holding most of the optimizer's parameters, fewest
parameters in all on a tie (a DataParallel or Fabric wrapper is looked through; DDP's and DeepSpeed's, which decide
which ranks record, by the recorder: ``upd.recorder.wrappers``). The file is RUN for the first group, then the next
part not written yet (``env.part_path``); several processes that train without a process group each take their own
part, because the recorder creates its file exclusively.
"""
from __future__ import annotations

import gc
import warnings

import torch

from .. import lifetime
from ..recorder import wrappers
from ..recorder.recorder import Recorder, RecorderWarning
from . import env

# Recorders this process started: held until the exit closes them (the lifetime registry holds them weakly).
_recorders: list[Recorder] = []
_next_part = 1  # the part this process tries first for its next group
_MAX_PARTS = 10_000  # parts tried before giving up: a run directory that full is not an accident


def start(request: str, optimizers: list, backward_counts: dict[int, int]) -> Recorder | None:
    """Record `optimizers` (one group) as the request in the launcher's variable says; `backward_counts` are the
    backward passes counted since they were created. Never raises unless the request says strict."""
    strict = False
    try:
        path, options = env.decode(request)
        strict = bool(options.get("strict"))
        optimizers = to_record(optimizers)
        if not optimizers:
            return None
        close_replaced(optimizers)
        recorder = open_part(path, owning_model(optimizers), optimizers, options)
        if recorder.active:
            recorder.add_earlier_backward_passes(backward_counts)
        _recorders.append(recorder)
        return recorder
    except Exception as exc:
        if strict:
            raise
        warnings.warn(f"torch-upd (upd record): cannot record {', '.join(type(o).__name__ for o in optimizers)} "
                      f"({type(exc).__name__}: {exc}); training continues unrecorded", RecorderWarning,
                      stacklevel=2)
        return None


def inner_optimizer(optimizer):
    """The optimizer whose step runs inside `optimizer`'s step, or None: a job optimizer's local one (a
    ZeroRedundancyOptimizer's), or the one a wrapper exposes (``upd.recorder.wrappers``)."""
    try:
        if wrappers.is_job_optimizer(optimizer):
            inner = wrappers.local_optimizer(optimizer, None)
        else:
            inner = wrappers.optimizer_inside(optimizer)
    except Exception:
        return None
    return None if inner is optimizer else inner


def to_record(optimizers: list) -> list:
    """`optimizers` without those already recorded (by the program's own ``upd.record`` too) and those stepped
    inside another one's step, in their order."""
    recorded = {id(opt) for recorder in lifetime.recorders for opt in getattr(recorder, "optimizers", ())}
    inside = {id(inner) for inner in map(inner_optimizer, optimizers) if inner is not None}
    return [opt for opt in optimizers if id(opt) not in recorded and id(opt) not in inside]


def _param_ids(optimizers) -> set[int]:
    return {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}


def close_replaced(optimizers: list) -> None:
    """Close this process's earlier recordings whose optimizers step some of the same parameters: the program made
    a new optimizer for them (a restart, a new phase) and the old one is done. Closing also lets it be freed."""
    params = _param_ids(optimizers)
    for recorder in list(_recorders):
        if _param_ids(recorder.optimizers) & params:
            recorder.close()
            _recorders.remove(recorder)


def root_modules() -> list[torch.nn.Module]:
    """Every live nn.Module that is no other live module's child, in the garbage collector's order."""
    # type(), not isinstance(): isinstance reads __class__, which some objects compute (and warn or raise in).
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Module)]
    children = {id(child) for module in modules for child in vars(module).get("_modules", {}).values()
                if child is not None}
    return [module for module in modules if id(module) not in children]


def owner(param_ids: set[int], roots: list, root_params: list) -> object | None:
    """The root module holding most of `param_ids`, the smallest one on a tie; None when none holds any."""
    best, best_key = None, None
    for root, params in zip(roots, root_params):
        held = len(param_ids & params)
        key = (held, -len(params))
        if held and (best_key is None or key > best_key):
            best, best_key = root, key
    return best


def owning_model(optimizers: list):
    """What ``upd.record`` gets as ``model=`` for `optimizers`: the root module that owns their parameters, several
    of them as one (``Models``) when each optimizer's has its own (a GAN's generator and discriminator), or None."""
    roots, root_params = [], []
    for root in root_modules():
        try:
            root_params.append({id(p) for p in root.parameters()})
        except Exception:
            continue
        roots.append(root)
    owners = []
    for opt in optimizers:
        found = owner(_param_ids([opt]), roots, root_params)
        if found is not None and not any(found is o for o in owners):
            owners.append(found)
    if not owners:
        return None
    if len(owners) == 1:
        # Through the wrappers that only run it (DataParallel, Fabric): the recorder must see a parallelism's own
        # (DDP, DeepSpeed) to decide which ranks record, and looks through it itself.
        return wrappers.model_inside(owners[0], through_parallelisms=False)
    return Models(owners)


class Models:
    """Several models as one ``model=``: each parameter under its name in its own model (each optimizer's
    parameters come from one of them, so names stay unique within an optimizer)."""

    def __init__(self, models: list):
        self.models = [wrappers.model_inside(m) for m in models]

    def named_parameters(self):
        for model in self.models:
            yield from model.named_parameters()

    def parameters(self):
        for _, param in self.named_parameters():
            yield param


def open_part(path: str, model, optimizers: list, options: dict) -> Recorder:
    """A recorder of `optimizers` into the first part of RUN that this process may write: with resume, the part
    this group had in the earlier run (the process's groups in order); otherwise the first not written yet."""
    global _next_part
    part = _next_part
    while True:
        try:
            recorder = Recorder(env.part_path(path, part), model, optimizers, **options)
        except FileExistsError:
            # Another process of this command, or this one's earlier group, has it (the command refused to start
            # over an earlier run's files).
            if options.get("resume") or part >= _next_part + _MAX_PARTS:
                raise
            part += 1
            continue
        _next_part = part + 1
        return recorder
