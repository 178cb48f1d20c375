"""Backward passes counted per parameter, and the recorder's hooks kept out of torch.compile (``eager``).

Counting backward passes per parameter shows gradient accumulation and steps skipped by GradScaler (backward passes
that were followed by no optimizer step), which the optimizer's own counters cannot.
"""
from __future__ import annotations

import collections
from typing import Callable

import torch


def eager(hook):
    """`hook` excluded from torch.compile: a compiled ``optimizer.step`` (or model) calls the recorder's hooks, and
    dynamo must not trace them (tracing the copies and counts is slower than running them, 5.5x on a compiled step,
    and recompiles for every parameter shape). The recorder's work runs as it does in eager mode."""
    return torch.compiler.disable(hook, reason="torch-upd's recorder runs eagerly")


class BackwardCounts:
    """Backward passes per parameter, counted by a post-accumulate-grad hook on each parameter hooked, and the end of
    each backward pass signalled to the recorder (`on_count()`, where it queues its end-of-backward callback). Each
    hook's handle is appended to `handles` (removed by the recorder at close).

    A hook per parameter runs at every backward pass, so it must cost next to nothing: each parameter's is the
    builtin ``append`` of one list shared by all of them (no Python frame runs, hence nothing for torch.compile to
    trace), and the counts are folded from that list when asked (``passes``). A Python hook on every parameter cost
    the small models' backward pass more than the statistics of their step (docs/performance.md). `on_count` needs
    one call per backward pass, not one per parameter: one parameter at a time (the sentinel) carries a Python hook
    for it. A backward pass without the sentinel's gradient calls nothing; the next fold moves the sentinel to the
    parameter accumulated last (the first layers', used by every pass of most models)."""

    # the list is folded by the sentinel too when it grows this long: backward passes without optimizer steps
    # (gradients computed for another purpose) must not hold a reference per parameter and pass without bound
    FOLD_AT = 1 << 16

    def __init__(self, on_count: Callable[[], None], handles: list):
        self._counts: collections.Counter = collections.Counter()  # id(parameter) -> passes folded so far
        self._accumulated: list = []  # the parameters whose gradient was accumulated since the last fold, in order
        self._hooked: set[int] = set()  # id(parameter) of each parameter hooked
        self._on_count = on_count
        self._handles = handles
        self._sentinel = None  # the handle of the Python hook that calls on_count
        self._sentinel_fired = False  # since the last fold
        self._signal = eager(self._sentinel_hook)

    def hook(self, param: torch.Tensor) -> None:
        """Count `param`'s backward passes from now on (once per parameter; only leaves that take gradients)."""
        key = id(param)
        if key in self._hooked or not param.requires_grad or not param.is_leaf:
            return
        self._hooked.add(key)
        self._handles.append(param.register_post_accumulate_grad_hook(self._accumulated.append))
        if self._sentinel is None:
            self._move_sentinel(param)

    def _move_sentinel(self, param: torch.Tensor) -> None:
        if self._sentinel is not None:
            self._sentinel.remove()
        self._sentinel = param.register_post_accumulate_grad_hook(self._signal)
        self._handles.append(self._sentinel)

    def _sentinel_hook(self, _param) -> None:
        self._sentinel_fired = True
        if len(self._accumulated) >= self.FOLD_AT:
            self._fold()
        self._on_count()

    def _fold(self) -> None:
        accumulated = self._accumulated
        if not accumulated:
            return
        self._counts.update(map(id, accumulated))
        if not self._sentinel_fired:  # backward passes without the sentinel: the parameter every pass ended with
            self._move_sentinel(accumulated[-1])
        self._sentinel_fired = False
        accumulated.clear()

    def add(self, counts: dict[int, int]) -> None:
        """Passes counted before these counts began, added to the parameters hooked here."""
        for key, count in counts.items():
            if key in self._hooked:
                self._counts[key] += count

    def passes(self, layout: tuple) -> int:
        """Backward passes so far: the most any of an optimizer's parameters saw (`layout`: their ids,
        ``track.layout_of``; a parameter without a gradient in some passes saw fewer)."""
        self._fold()
        return max(map(self._counts.__getitem__, layout), default=0)
