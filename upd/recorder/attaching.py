"""What ``upd.record(path, model, optimizer)`` attaches to, through whatever wraps them: one call, ``attach``.

The user passes the model and the optimizer as the training loop holds them: wrapped by DDP, torch.compile,
Accelerate, Lightning, DeepSpeed, sharded by FSDP, partitioned by ZeRO. ``attach`` asks the wrapper registry
(``wrappers``: one module per kind, ``wrapper_registry``) what they are: the job's optimizers (optimizer wrappers
looked through, down to a job optimizer such as ZeRO's), this process's part in a distributed job (decided from the
wrappers as given), the module whose names the run uses, and the ``torch.optim.Optimizer`` whose step hooks the
recorder uses on this rank. What cannot be attached to is a TypeError saying what was passed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import distributed, wrappers
from .distributed import RankSetup
from .wrappers.optimizer_wrappers import WRAPPED_OPTIMIZER_ATTRIBUTES


@dataclass(frozen=True)
class Attached:
    """What a recorder attaches to on this process."""

    model: object  # the module names come from (every wrapper looked through), or None
    # the job's optimizers (optimizer wrappers looked through), or what holds their logical parameters by param
    # group where they hold something else (wrappers.job_parameters)
    job_optimizers: list
    optimizers: list  # the torch.optim.Optimizer hooked on this rank, one per job optimizer
    rank_setup: RankSetup | None  # this process's part in a distributed job; None in a single process
    global_names: list  # per optimizer: {id(parameter): name} that the optimizer's own places would get wrong


def attach(path, model, optimizer, ranks) -> Attached:
    """The Attached of ``upd.record(path, model, optimizer, ranks=ranks)``; TypeError for what cannot be recorded."""
    if optimizer is None and model is not None and is_optimizer(model):
        raise TypeError("the optimizer was passed as the model (upd.record's second argument); write "
                        "upd.record(path, model, optimizer), or upd.record(path, "
                        f"optimizer={call_name(model)}) without a model")
    job_optimizers = [wrappers.job_optimizer(opt) for opt in attachable_optimizers(optimizer)]
    check_model(model)
    # Which ranks record, into which file: decided from the wrappers as the user passed them (DDP, ZeRO, FSDP,
    # DeepSpeed); recording then looks through them.
    models = wrappers.model_chain(model)
    rank_setup = distributed.setup(path, models, job_optimizers, ranks)
    inner = models[-1] if models else None
    optimizers = [wrappers.local_optimizer(opt, inner) for opt in job_optimizers]
    for opt in optimizers:
        check_hookable(opt)
    names = [{**wrappers.global_names(job), **wrappers.global_names(local)}
             for job, local in zip(job_optimizers, optimizers)]
    return Attached(model=inner, job_optimizers=[wrappers.job_parameters(opt) for opt in job_optimizers],
                    optimizers=optimizers, rank_setup=rank_setup, global_names=names)


def attachable_optimizers(optimizer) -> list:
    """``optimizer=`` as the list of the job's optimizers, each looked up through its wrappers; TypeError for
    anything that is not, or does not wrap, a torch.optim.Optimizer (or a job optimizer such as ZeRO's)."""
    if optimizer is None:
        raise TypeError("upd.record needs the optimizer (or a list of optimizers) to watch")
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    found = [wrappers.optimizer_inside(opt) for opt in given]
    for opt in found:
        if not (isinstance(opt, torch.optim.Optimizer) or wrappers.is_job_optimizer(opt)):
            raise TypeError(f"expected a torch.optim.Optimizer, or a wrapper that exposes one as "
                            f"{', '.join('.' + a for a in WRAPPED_OPTIMIZER_ATTRIBUTES)}; got {type(opt).__name__}")
    return found


def check_hookable(optimizer) -> None:
    """TypeError when torch cannot call step hooks on `optimizer`: a subclass whose ``__init__`` never ran
    ``torch.optim.Optimizer.__init__`` (a wrapper that hides what it wraps)."""
    if not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        raise TypeError(f"{type(optimizer).__name__} has no optimizer step hooks (torch.optim.Optimizer.__init__ "
                        "never ran for it); pass the optimizer it wraps")


def check_model(model) -> None:
    """TypeError for a ``model=`` without ``named_parameters()``."""
    if model is not None and not callable(wrappers.attribute(model, "named_parameters")):
        raise TypeError(f"model= must be a torch.nn.Module (names come from its named_parameters()), got "
                        f"{type(model).__name__}")


def is_optimizer(obj) -> bool:
    """`obj` is, or wraps, a torch.optim.Optimizer (or a job optimizer)."""
    inner = wrappers.optimizer_inside(obj)
    return isinstance(inner, torch.optim.Optimizer) or wrappers.is_job_optimizer(inner)


def call_name(obj) -> str:
    return "optimizer" if isinstance(obj, torch.optim.Optimizer) else type(obj).__name__
