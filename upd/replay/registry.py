"""Registry of replay rules, keyed by optimizer class, and the adapter that runs a rule on one recorded step.

A replay rule recomputes one optimizer step for one parameter, in float64, from what the recorder stored:

    rule(param, grad, state, group, step) -> Replayed(param=..., state={...})

- param, grad: float64 tensors as recorded before the step;
- state: the optimizer state before the step, a dict of float64 tensors. A rule registered with ``state={...}``
  gets every declared entry, created by its initialiser on the first step; otherwise the recorded dict as is ({} on
  the first step);
- group: that parameter's param-group hyperparameters, JSON-decoded; tensor hyperparameters arrive as floats (a
  tensor of several elements as a list of floats);
- step: the steps done before this one: the state's ``step`` counter for a rule registered with
  ``counts_steps=True``, else the optimizer's recorded step count.

The adapter does the bookkeeping every rule would otherwise repeat: creating the state on the first step, checking
that a later step's record holds the declared state, reading the step counter and storing step + 1 in the replayed
state, and storing numbers as float64 tensors. A rule is left with the optimizer's math. Rules raise
NotReplayable(reason) when the record lacks something they need.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

import torch

from ..runfile.encoding import class_path

# The state entry in which torch.optim optimizers keep their step counter.
STEP_KEY = "step"

DEFAULT_RTOL = 1e-5
DEFAULT_ULPS = 4.0


class NotReplayable(Exception):
    """The record does not hold what this rule needs; the message says what."""


class UnusableRecord(Exception):
    """The recorded values are not what the rule declared it works on: the file's fault, not the rule's."""


class MissingHyperparameter(UnusableRecord, KeyError):
    """A rule read a hyperparameter that the recorded param group lacks (a KeyError, for rules that catch one)."""

    def __str__(self) -> str:
        return f"the recorded param group has no hyperparameter {self.args[0]!r}"


class ReplayRuleError(Exception):
    """A replay rule raised on recorded values it declared it works on: a bug in the rule, not in the file."""


class Hyperparameters(dict):
    """A param group as a rule reads it: a missing hyperparameter is the record's fault (MissingHyperparameter)."""

    def __missing__(self, key):
        raise MissingHyperparameter(key)


@dataclass
class Replayed:
    param: torch.Tensor
    state: dict = field(default_factory=dict)  # None values are entries the optimizer does not keep


# A state initialiser: (param, group) -> the entry's value before the first step (a tensor or a number).
Initialiser = Callable[[torch.Tensor, dict], Any]


def zeros(param: torch.Tensor, group: dict) -> torch.Tensor:
    """The usual initial state entry: zeros shaped like the parameter."""
    return torch.zeros_like(param)


@dataclass(frozen=True)
class KeptWhen:
    """A state entry the optimizer keeps only for some param groups or shapes (Adam's max_exp_avg_sq)."""

    condition: Callable[[torch.Tensor, dict], bool]
    init: Initialiser = zeros


def kept_when(condition: str | Callable[[torch.Tensor, dict], bool], init: Initialiser = zeros) -> KeptWhen:
    """A conditional state entry: ``condition`` is a hyperparameter name (kept when the group's value is true) or a
    function (param, group) -> bool."""
    if isinstance(condition, str):
        name = condition
        return KeptWhen(lambda param, group: bool(group.get(name, False)), init)
    return KeptWhen(condition, init)


def _kept_entries(declared: dict, param: torch.Tensor, group: dict) -> dict[str, Initialiser]:
    """Declared state entries the optimizer keeps for this parameter and group -> their initialisers."""
    kept = {}
    for key, spec in declared.items():
        if not isinstance(spec, KeptWhen):
            kept[key] = spec
        elif spec.condition(param, group):
            kept[key] = spec.init
    return kept


def _as_state_value(value):
    """State values as the engine compares them: float64 tensors (numbers become 0-d tensors)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), dtype=torch.float64)


def steps_done(counter) -> int:
    """The recorded step counter as a count; a counter that is not one is the record's fault."""
    try:
        value = float(counter)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UnusableRecord(f"the state's step counter is not a number ({exc})") from exc
    if not (math.isfinite(value) and 0 <= value < 2**53):
        raise UnusableRecord(f"the state's step counter is {value:g}, not a step count")
    return int(round(value))


def check_tolerances(rtol: float | None = None, ulps: float | None = None) -> None:
    """Raise ValueError unless each given tolerance is a finite number >= 0 (a negative or NaN one passes
    everything)."""
    for name, value in (("rtol", rtol), ("ulps", ulps)):
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not 0 <= number < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass
class ReplayRule:
    name: str  # the class path it was registered for
    fn: Callable
    rtol: float  # tolerance on the update, relative to the tensor's largest update; see docs/verify.md
    ulps: float  # tolerance on each element, in units of the storage dtype's spacing at that element
    torch_versions: tuple = (None, None)  # [min, max) torch versions whose optimizer this rule reproduces
    state: dict = field(default_factory=dict)  # declared state entries -> initialiser or KeptWhen
    counts_steps: bool = False  # the optimizer keeps a step counter in state["step"]
    # The math reads the whole tensor (row/column means, norms, matrix products): a rank's shard of a distributed
    # parameter cannot be replayed on its own.
    needs_whole_tensor: bool = False
    # The math treats each row along the first dimension as a unit (SparseAdam: a row of the gradient is present or
    # not): verify may cut the tensor into blocks of whole rows, and a shard made of whole rows replays on its own.
    needs_whole_rows: bool = False

    @property
    def function_name(self) -> str:
        """Where the rule's code is: module.function."""
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"

    def replay(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict,
               optimizer_step: int) -> Replayed:
        """Run the rule on one recorded step: ``state`` as recorded ({} on the first step), ``optimizer_step`` the
        optimizer's recorded step count. Raises NotReplayable, UnusableRecord (the file's fault), or whatever the
        rule raises."""
        group = Hyperparameters(group)
        kept = _kept_entries(self.state, param, group)
        step = optimizer_step
        if state:
            missing = [k for k in (*kept, *((STEP_KEY,) if self.counts_steps else ())) if k not in state]
            if missing:
                raise NotReplayable(f"state lacks {', '.join(missing)}")
            inputs = dict(state)
            if self.counts_steps:
                step = steps_done(inputs.pop(STEP_KEY))
        else:  # the first step: the optimizer creates its state
            inputs = {k: _as_state_value(init(param, group)) for k, init in kept.items()}
            if self.counts_steps:
                step = 0
        try:
            out = self.fn(param, grad, inputs, group, step)
        except (NotReplayable, UnusableRecord):
            raise
        except Exception as exc:
            conflict = _shape_conflict(inputs, kept, param, group)
            if conflict:
                raise UnusableRecord(conflict) from exc
            raise
        if not isinstance(out, Replayed):
            raise TypeError(f"returned {type(out).__name__}, not upd.replay.Replayed")
        if not isinstance(out.param, torch.Tensor) or out.param.shape != param.shape:
            raise TypeError(f"returned a parameter of shape {tuple(getattr(out.param, 'shape', ()))}, not "
                            f"{tuple(param.shape)}")
        new_state = {k: _as_state_value(v) for k, v in out.state.items() if v is not None}
        if self.counts_steps:
            new_state[STEP_KEY] = _as_state_value(step + 1)
        return Replayed(out.param, new_state)


def same_shape(recorded: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two state values can be compared element for element (a recorded 0-d value may read as (1,))."""
    try:
        return (recorded.numel() == other.numel()
                and torch.broadcast_shapes(recorded.shape, other.shape) == recorded.shape)
    except RuntimeError:
        return False


def _shape_conflict(inputs: dict, kept: dict, param, group) -> str | None:
    """Why the recorded state cannot be what the rule declared (an entry of another shape), or None."""
    for key, init in kept.items():
        recorded = inputs.get(key)
        if isinstance(recorded, torch.Tensor):
            expected = _as_state_value(init(param, group))
            if not same_shape(recorded, expected):
                return (f"state {key!r} has shape {tuple(recorded.shape)}, the optimizer keeps it as "
                        f"{tuple(expected.shape)}")
    return None


# class path -> rules, newest registration first; several rules for one class cover different torch versions.
_RULES: dict[str, list[ReplayRule]] = {}


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
             torch_min: str | None = None, torch_below: str | None = None, state: dict | None = None,
             counts_steps: bool = False, elementwise: bool = False, needs_whole_rows: bool = False,
             needs_whole_tensor: bool = False):
    """Decorator: register ``fn`` as the replay rule of the given optimizer classes (classes or 'module.Class').

        @upd.replay.register(MyOptimizer)
        def my_rule(param, grad, state, group, step):
            return upd.replay.Replayed(param - group["lr"] * grad.sign())

    ``state`` declares the optimizer's state entries, each with its initialiser ``(param, group) -> value`` (e.g.
    ``upd.replay.zeros``) or ``upd.replay.kept_when(condition, init)`` for an entry kept only for some groups: the
    rule then gets them created on the first step, and a later step whose record lacks one is skipped.
    ``counts_steps=True``: the optimizer keeps a step counter in ``state["step"]``; the rule gets it as ``step``.
    ``torch_min`` / ``torch_below`` limit the rule to files written by those torch versions, for optimizers whose
    math changed between versions: ``verify`` picks the rule matching the torch version recorded in the file.
    ``elementwise=True``: each element's update depends only on that element's parameter, gradient and state
    (SGD, Adam, ...): verify replays the rule on bounded blocks of the flattened tensor, in cache-sized chunks, and
    on a rank's shard of a distributed parameter as it is. Without it (the default, because it is always correct)
    the rule gets the whole tensor (memory: a few float64 copies of it) and a shard of a distributed parameter is
    skipped, saying so, instead of being replayed as if it were the whole tensor. ``needs_whole_rows=True``: the
    math treats rows along the first dimension as units; verify cuts the tensor into blocks of whole rows only.
    ``needs_whole_tensor=True`` is the default's explicit spelling, kept for rules written before ``elementwise``.
    Registering again for the same class and versions replaces the earlier rule.
    """
    if not optimizer_classes:
        raise TypeError("register() needs at least one optimizer class")
    check_tolerances(rtol, ulps)

    def decorator(fn):
        for cls in optimizer_classes:
            name = class_path(cls)
            rule = ReplayRule(name=name, fn=fn, rtol=rtol, ulps=ulps, torch_versions=(torch_min, torch_below),
                              state=dict(state or {}), counts_steps=counts_steps,
                              needs_whole_tensor=needs_whole_tensor or not (elementwise or needs_whole_rows),
                              needs_whole_rows=needs_whole_rows)
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
