"""Hyperparameters and step counters read from a run file, checked and converted before any replay rule sees them.

A rule does the optimizer's arithmetic on whatever it is given: an integer ``beta1`` of 3 and a step counter of 1e9
make ``beta1 ** step`` a Python integer with hundreds of millions of digits (a verify that never ends), and a string
``lr`` makes the rule raise, which would blame the rule (exit 4). torch itself accepts only numbers of the right kind
and range for these; a value in a file that torch would refuse is the file's fault (exit 2, naming the field).

Pure functions: each takes the decoded value and returns it as torch takes it (a float, a tuple of floats, an int)
or raises :class:`BadHyperparameter` with what is wrong. Fields no rule reads, and fields whose values rules only
compare (``adjust_lr_fn``, ``line_search_fn``), pass unchanged.
"""
from __future__ import annotations

import math
import numbers

import numpy as np


class BadHyperparameter(ValueError):
    """A recorded hyperparameter or step counter torch would not accept; ``field`` names it."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field


def _real(field: str, value) -> float:
    """A finite real number as float (an int too, as torch converts it; never a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadHyperparameter(field, f"is {_shown(value)}, not a number")
    try:
        number = float(value)
    except OverflowError:
        raise BadHyperparameter(field, "is an integer too large for a float") from None
    if not math.isfinite(number):
        raise BadHyperparameter(field, f"is {number}, not a finite number")
    return number


def _reals(field: str, value, count: int, *, optional: bool = False) -> tuple:
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise BadHyperparameter(field, f"is {_shown(value)}, not a list of {count} numbers")
    return tuple(None if optional and v is None else _real(f"{field}[{i}]", v) for i, v in enumerate(value))


def _betas(field: str, value) -> tuple:
    betas = _reals(field, value, 2)
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:  # torch's own range check (Adam, AdamW, Adamax, NAdam, RAdam, SparseAdam)
            raise BadHyperparameter(f"{field}[{i}]", f"is {beta}, outside [0, 1)")
    return betas


def _eps(field: str, value):
    # Adafactor keeps a pair (eps1 may be None: the dtype's eps); every other optimizer one number
    return _reals(field, value, 2, optional=True) if isinstance(value, (list, tuple)) else _real(field, value)


def _flag(field: str, value):
    if value is not None and not isinstance(value, bool):
        raise BadHyperparameter(field, f"is {_shown(value)}, not true or false")
    return value


def _ns_steps(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < 100:
        raise BadHyperparameter(field, f"is {_shown(value)}, not an integer in [0, 100)")  # torch's Muon bound
    return int(value)


def _etas(field: str, value) -> tuple:
    etas = _reals(field, value, 2)
    if not 0.0 < etas[0] < 1.0 < etas[1]:  # torch's own check (Rprop)
        raise BadHyperparameter(field, f"is {list(etas)}, not 0 < etaminus < 1 < etaplus (torch refuses it)")
    return etas


# The ranges torch's constructors accept, per field (inclusive bounds, None: unbounded), as they check them (torch
# 2.x): a number outside is refused by torch, so it is the file's fault, never a mismatch. A field is listed only
# where every optimizer that has it refuses the same values (RMSprop's alpha >= 0 is not ASGD's alpha: not listed).
# betas ([0, 1)) and etas are checked by _betas and _etas.
# Not lr: torch checks it only in the constructor, and a schedule or the user's own code that sets it below zero
# later trains on with it (gradient ascent), so a recorded negative lr is a real run, which replays as any other.
RANGES = {
    "eps": (0.0, None),  # each of Adafactor's pair too
    "weight_decay": (0.0, None),
    "momentum": (0.0, None),  # SGD, RMSprop, Muon
    "lr_decay": (0.0, None),  # Adagrad
    "initial_accumulator_value": (0.0, None),  # Adagrad
    "momentum_decay": (0.0, None),  # NAdam
    "rho": (0.0, 1.0),  # Adadelta
    "d": (1.0, None),  # Adafactor's clipping threshold
    "beta2_decay": (None, 0.0),  # Adafactor
}


def _in_range(field: str, value):
    """`value` (a number, or a tuple of numbers and None) within RANGES[field]; BadHyperparameter naming it if not."""
    low, high = RANGES[field]
    for i, number in enumerate(value) if isinstance(value, tuple) else ((None, value),):
        if number is not None and ((low is not None and number < low) or (high is not None and number > high)):
            allowed = (f"[{low:g}, {high:g}]" if low is not None and high is not None else
                       f"at least {low:g}" if low is not None else f"at most {high:g}")
            raise BadHyperparameter(field if i is None else f"{field}[{i}]",
                                    f"is {number:g}, outside {allowed} (torch refuses it)")
    return value


REAL_FIELDS = ("lr", "weight_decay", "momentum", "dampening", "alpha", "lambd", "t0", "rho", "lr_decay",
               "initial_accumulator_value", "momentum_decay", "beta2_decay", "d")
FLAG_FIELDS = ("maximize", "amsgrad", "nesterov", "capturable", "differentiable", "foreach", "fused", "centered",
               "decoupled_weight_decay")
CHECKS = {**{name: _real for name in REAL_FIELDS}, **{name: _flag for name in FLAG_FIELDS},
          "betas": _betas, "eps": _eps, "ns_steps": _ns_steps,
          "etas": _etas,
          "step_sizes": lambda field, value: _reals(field, value, 2),
          "ns_coefficients": lambda field, value: _reals(field, value, 3)}


def checked_group(group: dict) -> dict:
    """A decoded param group with every hyperparameter a rule reads checked and converted as torch takes it."""
    checked = {key: CHECKS[key](key, value) if key in CHECKS else value for key, value in group.items()}
    return {key: _in_range(key, value) if key in RANGES else value for key, value in checked.items()}


def check_step_counters(values, most: int) -> None:
    """Recorded per-parameter step counters (any shape, one per row): each an integer in [0, most], `most` the
    largest step the run's optimizer recorded. Raises BadHyperparameter naming the first that is not."""
    counters = np.asarray(values, dtype=np.float64).reshape(-1)
    bad = ~np.isfinite(counters) | (counters < 0) | (counters > most) | (counters != np.round(counters))
    if bad.any():
        first = float(counters[int(np.argmax(bad))])
        raise BadHyperparameter("state 'step'", f"(the step counter) is {first:g}, not a step count in [0, {most}] "
                                                "(the run's largest recorded step)")


def _shown(value) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit for str()
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:37] + "..."
