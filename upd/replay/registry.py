"""Registry of replay rules, keyed by optimizer class.

A replay rule recomputes one optimizer step for one parameter, in float64, from what the recorder stored:

    rule(param, grad, state, group, step) -> Replayed(param=..., state={...})

- param, grad: float64 tensors as recorded before the step;
- state: the optimizer state before the step as a dict of float64 tensors ({} on the first step);
- group: that parameter's param-group hyperparameters, JSON-decoded (tensor hyperparameters already unwrapped to
  floats or lists of floats by the engine);
- step: optimizer steps completed before this one.

Rules raise NotReplayable(reason) when the record lacks something they need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import torch


class NotReplayable(Exception):
    """The record does not hold what this rule needs; the message says what."""


@dataclass
class Replayed:
    param: torch.Tensor
    state: dict = field(default_factory=dict)
    # A rule may loosen its registered tolerance for this step, e.g. for a fused kernel that rounds differently;
    # docs/verify.md must say why.
    rtol: float | None = None


@dataclass
class ReplayRule:
    name: str  # the class path it was registered for
    fn: Callable
    rtol: float  # tolerance on the update, relative to the tensor's largest update; see docs/verify.md
    ulps: float  # tolerance on each element, in units of the storage dtype's spacing at that element


_RULES: dict[str, ReplayRule] = {}

DEFAULT_RTOL = 1e-5
DEFAULT_ULPS = 4.0


def class_path(cls: Union[type, str]) -> str:
    if isinstance(cls, str):
        return cls
    public = getattr(torch.optim, cls.__name__, None)
    return f"torch.optim.{cls.__name__}" if public is cls else f"{cls.__module__}.{cls.__qualname__}"


def register(*optimizer_classes, rtol: float = DEFAULT_RTOL, ulps: float = DEFAULT_ULPS):
    """Decorator: register ``fn`` as the replay rule of the given optimizer classes (classes or 'module.Class').

        @upd.replay.register(MyOptimizer)
        def my_rule(param, grad, state, group, step):
            return upd.replay.Replayed(param - group["lr"] * grad.sign())
    """
    if not optimizer_classes:
        raise TypeError("register() needs at least one optimizer class")

    def decorator(fn):
        for cls in optimizer_classes:
            name = class_path(cls)
            _RULES[name] = ReplayRule(name=name, fn=fn, rtol=rtol, ulps=ulps)
        return fn

    return decorator


def unregister(optimizer_class) -> None:
    _RULES.pop(class_path(optimizer_class), None)


def lookup(class_name: str, mro=()) -> ReplayRule | None:
    """The rule for a recorded optimizer class, else for its nearest registered base class (as recorded)."""
    for name in (class_name, *mro):
        if name in _RULES:
            return _RULES[name]
        # Files record defining-module paths in the MRO (torch.optim.adam.Adam); rules use torch.optim.Adam.
        short = f"torch.optim.{name.rsplit('.', 1)[-1]}" if name.startswith("torch.optim.") else None
        if short in _RULES:
            return _RULES[short]
    return None


def registered() -> list[str]:
    return sorted(_RULES)
