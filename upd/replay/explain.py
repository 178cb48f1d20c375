"""Explain a mismatch by replaying the usual suspects and keeping the one that reproduces the record.

Each hypothesis is a modified replay (weight decay dropped or doubled, another lr, a scaled gradient). One whose
parameter *and* next-step optimizer state match the record under the normal tolerance is the explanation. Scales
are fitted to the recorded update and state, so "the gradient was clipped to x0.08" comes with its factor. Only
mismatching steps pay for this.
"""
from __future__ import annotations

from typing import Callable

import torch

# A fitted factor this close to 1 is rounding, not a cause.
_MIN_SCALE_CHANGE = 1e-5


def _as_vector(param_update: torch.Tensor, state: dict, keys: list, scales: dict, with_param: bool) -> torch.Tensor:
    parts = [param_update.flatten() / scales["param"]] if with_param else []
    parts += [state[k].flatten() / scales[k] for k in keys]
    return torch.cat(parts)


def fit_scale(vector_at: Callable[[float], torch.Tensor | None], target: torch.Tensor) -> float | None:
    """Factor k for which vector_at(k) best matches target, by 1-D Gauss-Newton from k = 1.

    The derivative is a central difference, exact for the affine and quadratic dependencies replay rules have
    (SGD is affine in lr and gradient, Adam's second moment is quadratic in the gradient)."""
    k = 1.0
    for _ in range(8):
        h = 1e-3 * max(abs(k), 1e-3)
        u, up, um = vector_at(k), vector_at(k + h), vector_at(k - h)
        if u is None or up is None or um is None:
            return None
        direction = (up - um) / (2 * h)
        d = float(direction @ direction)
        if d == 0 or not torch.isfinite(direction).all():
            return None
        delta = float(direction @ (target - u)) / d
        k += delta
        if abs(delta) <= 1e-12 * max(1.0, abs(k)):
            break
    return k


def explain(replay_with: Callable, before, grad, after, group: dict, next_state: dict | None,
            matches: Callable[[torch.Tensor, dict], bool]) -> str | None:
    """A sentence saying what most likely happened, or None.

    replay_with(grad, group) replays the step with another gradient or param group (a ``Replayed``).
    matches(replayed_param, replayed_state) applies verify's tolerance to the parameter and, when the next step's
    state was recorded (next_state), to the state."""
    def replay(g=grad, grp=group):
        try:
            return replay_with(g, grp)
        except Exception:  # a hypothesis the rule cannot replay is not the explanation
            return None

    recorded_update = after - before
    if bool((recorded_update == 0).all()) and not bool((grad == 0).all()):
        return "the parameter did not change although it had a gradient: the step was skipped for it"

    keys = sorted(next_state or {})
    scales = {"param": float(recorded_update.abs().max()) or 1.0}
    for key in keys:
        scales[key] = float(next_state[key].abs().max()) or 1.0

    def fit(make):
        # Fit on the next state when the hypothesis moves it (it is recorded to float32 precision, while a
        # normalised update like Adam's barely depends on the gradient's scale); else on the update.
        for part in (keys, None):
            if part == []:
                continue
            target = _as_vector(recorded_update, next_state or {}, part or [], scales, with_param=part is None)

            def vector_at(s, part=part):
                replayed = make(s)
                if replayed is None or any(k not in replayed.state for k in part or []):
                    return None
                return _as_vector(replayed.param - before, replayed.state, part or [], scales,
                                  with_param=part is None)
            k = fit_scale(vector_at, target)
            if k is not None:
                return k
        return None

    def accepted(replayed) -> bool:
        return replayed is not None and matches(replayed.param, replayed.state)

    wd = group.get("weight_decay", 0)
    if isinstance(wd, (int, float)) and wd:
        for factor, words in ((0.0, "weight decay was not applied"), (2.0, "weight decay was applied twice")):
            if accepted(replay(grp=dict(group, weight_decay=wd * factor))):
                return f"{words} (the update matches weight_decay={wd * factor:g}, the group says {wd:g})"

    found = {}
    lr = group.get("lr")
    if isinstance(lr, (int, float)) and lr:
        k = fit(lambda s: replay(grp=dict(group, lr=lr * s)))
        if k is not None and abs(k - 1) > _MIN_SCALE_CHANGE and accepted(replay(grp=dict(group, lr=lr * k))):
            found["lr"] = k
    k = fit(lambda s: replay(g=grad * s))
    if k is not None and abs(k - 1) > _MIN_SCALE_CHANGE and accepted(replay(g=grad * k)):
        found["grad"] = k

    grad_words = ("the optimizer used a gradient x{k:.4g} the recorded one: it was changed after the recorder's "
                  "hook (gradient clipping or scaling in a later step pre-hook, unscaling)")
    lr_words = "the update matches lr={lr:.4g}, not the param group's lr={group_lr:g} (x{k:.4g})"
    if "lr" in found and "grad" in found:
        # Plain SGD cannot tell them apart: both scale the update and nothing else.
        return ("the update is x{k:.4g} the replayed one; with this optimizer that is either ".format(k=found["lr"])
                + lr_words.format(lr=lr * found["lr"], group_lr=lr, k=found["lr"]) + ", or "
                + grad_words.format(k=found["grad"]))
    if "lr" in found:
        return lr_words.format(lr=lr * found["lr"], group_lr=lr, k=found["lr"])
    if "grad" in found:
        return grad_words.format(k=found["grad"])
    return None
