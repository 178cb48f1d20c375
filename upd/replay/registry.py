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

import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

import torch

from ..runfile.encoding import class_path


class NotReplayable(Exception):
    """The record does not hold what this rule needs; the message says what."""


def scalar(value) -> float:
    """A hyperparameter as a float: tensor hyperparameters arrive as [value] lists or floats."""
    return float(value[0] if isinstance(value, list) else value)


def require(state: dict, keys) -> None:
    """Raise NotReplayable naming the state keys a rule needs that the record lacks."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise NotReplayable(f"state lacks {', '.join(missing)}")


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
    torch_versions: tuple = (None, None)  # [min, max) torch versions whose optimizer this rule reproduces


# class path -> rules, newest registration first; several rules for one class cover different torch versions.
_RULES: dict[str, list[ReplayRule]] = {}

DEFAULT_RTOL = 1e-5
DEFAULT_ULPS = 4.0


def _version_tuple(version: str | None) -> tuple:
    """'2.13.0+cpu' -> (2, 13, 0); unparseable parts end the tuple."""
    out = []
    for part in (version or "").split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits or digits != part:
            if digits:
                out.append(int(digits))
            break
        out.append(int(digits))
    return tuple(out)


def _covers(rule: ReplayRule, torch_version: str | None) -> bool:
    low, high = rule.torch_versions
    if torch_version is None or (low is None and high is None):
        return True
    v = _version_tuple(torch_version)
    return (low is None or v >= _version_tuple(low)) and (high is None or v < _version_tuple(high))


def register(*optimizer_classes, rtol: float = DEFAULT_RTOL, ulps: float = DEFAULT_ULPS,
             torch_min: str | None = None, torch_below: str | None = None):
    """Decorator: register ``fn`` as the replay rule of the given optimizer classes (classes or 'module.Class').

        @upd.replay.register(MyOptimizer)
        def my_rule(param, grad, state, group, step):
            return upd.replay.Replayed(param - group["lr"] * grad.sign())

    ``torch_min`` / ``torch_below`` limit the rule to files written by those torch versions, for optimizers whose
    math changed between versions: ``verify`` picks the rule matching the torch version recorded in the file.
    Registering again for the same class and versions replaces the earlier rule.
    """
    if not optimizer_classes:
        raise TypeError("register() needs at least one optimizer class")

    def decorator(fn):
        for cls in optimizer_classes:
            name = class_path(cls)
            rule = ReplayRule(name=name, fn=fn, rtol=rtol, ulps=ulps, torch_versions=(torch_min, torch_below))
            others = [r for r in _RULES.get(name, []) if r.torch_versions != rule.torch_versions]
            _RULES[name] = [rule] + others
        return fn

    return decorator


def unregister(optimizer_class) -> None:
    _RULES.pop(class_path(optimizer_class), None)


def lookup(class_name: str, mro=(), torch_version: str | None = None) -> ReplayRule | None:
    """The rule for a recorded optimizer class (else its nearest registered base class, as recorded) that covers
    the torch version which wrote the file."""
    for name in (class_name, *mro):
        # Files record defining-module paths in the MRO (torch.optim.adam.Adam); rules use torch.optim.Adam.
        short = f"torch.optim.{name.rsplit('.', 1)[-1]}" if name.startswith("torch.optim.") else None
        for key in (name, short):
            for rule in _RULES.get(key, []):
                if _covers(rule, torch_version):
                    return rule
    return None


def registered() -> list[str]:
    return sorted(_RULES)


ENTRY_POINT_GROUP = "torch_upd.replay_rules"


def load_plugins(modules=()) -> list[str]:
    """Import the modules that register third-party rules: the given module names, and every entry point in the
    ``torch_upd.replay_rules`` group of the installed distributions. Returns what was loaded."""
    loaded = []
    for name in modules:
        importlib.import_module(name)
        loaded.append(name)
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10
        eps = metadata.entry_points().get(ENTRY_POINT_GROUP, [])
    for ep in eps:
        ep.load()
        loaded.append(ep.value)
    return loaded
