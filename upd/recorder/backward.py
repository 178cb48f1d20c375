"""Backward passes counted per parameter, and the recorder's hooks kept out of torch.compile (``eager``).

Counting backward passes per parameter shows gradient accumulation and steps skipped by GradScaler (backward passes
that were followed by no optimizer step), which the optimizer's own counters cannot.
"""
from __future__ import annotations

from typing import Callable

import torch


def eager(hook):
    """`hook` excluded from torch.compile: a compiled ``optimizer.step`` (or model) calls the recorder's hooks, and
    dynamo must not trace them (tracing the copies and counts is slower than running them, 5.5x on a compiled step,
    and recompiles for every parameter shape). The recorder's work runs as it does in eager mode."""
    return torch.compiler.disable(hook, reason="torch-upd's recorder runs eagerly")


class BackwardCounts:
    """Backward passes per parameter (``id(parameter) -> count``), counted by a post-accumulate-grad hook on each
    parameter hooked. `on_count()` runs after each count (the recorder queues its end-of-backward callback there);
    each hook's handle is appended to `handles` (removed by the recorder at close)."""

    def __init__(self, on_count: Callable[[], None], handles: list):
        self._counts: dict[int, int] = {}
        self._on_count = on_count
        self._handles = handles

    def hook(self, param: torch.Tensor) -> None:
        """Count `param`'s backward passes from now on (once per parameter; only leaves that take gradients)."""
        key = id(param)
        if key in self._counts or not param.requires_grad or not param.is_leaf:
            return
        self._counts[key] = 0

        def count(_param, key=key):
            self._counts[key] += 1
            self._on_count()

        self._handles.append(param.register_post_accumulate_grad_hook(eager(count)))

    def add(self, counts: dict[int, int]) -> None:
        """Passes counted before these counts began, added to the parameters hooked here."""
        for key, count in counts.items():
            if key in self._counts:
                self._counts[key] += count

    def passes(self, optimizer: torch.optim.Optimizer) -> int:
        """Backward passes so far: the most any of the optimizer's parameters saw (a parameter without a gradient in
        some passes saw fewer)."""
        return max((self._counts.get(id(p), 0) for g in optimizer.param_groups for p in g["params"]), default=0)
