"""The flight recorder (``upd.record(..., flight_recorder=K)``): the last K steps' full snapshots of each optimizer,
kept in memory, written to the run only when a step looks wrong.

Training that goes well costs no disk I/O; when a gradient or an update turns non-finite, or its norm jumps above
``spike_factor`` times its recent median, the K steps that led there are written and replay like any others.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time

import torch

from ..runfile.record import Record
from .snapshots import wait_for_copies

NORM_HISTORY = 50  # steps whose norms make the "recent median" of the spike rule
MIN_HISTORY = 5  # steps needed before a spike can be called at all


def step_norms(rec: Record) -> tuple[float, float]:
    """L2 norms of the whole gradient and the whole update over all parameters (float64, of the CPU snapshots): a
    NaN/Inf anywhere makes the norm non-finite. 0.0 when there is nothing to measure."""
    wait_for_copies()  # snapshots of CUDA tensors: their non_blocking copies must have landed
    grads = [s.grad for s in rec.params if s.grad is not None]
    updates = [s.param_after - s.param for s in rec.params if s.param is not None and s.param_after is not None]
    return _norm(grads), _norm(updates)


def _norm(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])))


def trigger_reason(step: int, grad_norm: float, update_norm: float, history, spike_factor: float) -> str | None:
    """Why this step should be dumped, or None: a non-finite gradient or update, or a norm above spike_factor times
    its median over `history` ((grad norm, update norm) of recent steps; no spike is called on fewer than
    MIN_HISTORY)."""
    if not math.isfinite(grad_norm):
        return f"non-finite gradient at step {step}"
    if not math.isfinite(update_norm):
        return f"non-finite update at step {step}"
    if len(history) < MIN_HISTORY:
        return None
    median_grad = statistics.median(h[0] for h in history)
    median_update = statistics.median(h[1] for h in history)
    if median_grad > 0 and grad_norm > spike_factor * median_grad:
        return (f"gradient norm spike at step {step}: {grad_norm:.3g} > {spike_factor:g} x "
                f"recent median {median_grad:.3g}")
    if median_update > 0 and update_norm > spike_factor * median_update:
        return (f"update norm spike at step {step}: {update_norm:.3g} > {spike_factor:g} x "
                f"recent median {median_update:.3g}")
    return None


@dataclasses.dataclass
class _OptimizerFlight:
    """One optimizer's part of the flight recorder."""

    ring: collections.deque  # full records of the last K steps
    norms: collections.deque  # (grad norm, update norm) of recent steps whose norms were finite
    written: collections.deque  # steps already in the file (chosen by every=, or dumped): never written twice


class FlightRecorder:
    """Keeps each optimizer's last `steps` full records, writes what every=/stats_every= ask for, and dumps the kept
    records through `writer` on a trigger or on request."""

    def __init__(self, writer, optimizers: int, steps: int, spike_factor: float):
        self._writer = writer
        self.spike_factor = spike_factor
        self._flights = [_OptimizerFlight(ring=collections.deque(maxlen=steps),
                                          norms=collections.deque(maxlen=NORM_HISTORY),
                                          written=collections.deque(maxlen=max(64, 2 * steps)))
                         for _ in range(optimizers)]
        self.dumps: list[dict] = []  # what each dump wrote, and why
        self.records_dumped = 0

    def step(self, rec: Record, selected: bool) -> None:
        """One step's full record (`rec.stats` set at a statistics step): written now as far as `selected` (chosen
        by every=) and the statistics ask, kept in memory, and the memory dumped if the step triggers."""
        flight = self._flights[rec.optimizer]
        if selected or rec.stats is not None:
            self._writer.write(dataclasses.replace(rec, full=selected))
            if selected:
                flight.written.append(rec.step)
        flight.ring.append(dataclasses.replace(rec, stats=None, full=True, scalars=[]))  # scalars: written once
        grad_norm, update_norm = step_norms(rec)
        reason = trigger_reason(rec.step, grad_norm, update_norm, flight.norms, self.spike_factor)
        if math.isfinite(grad_norm) and math.isfinite(update_norm):
            flight.norms.append((grad_norm, update_norm))
        if reason:
            self._dump(rec.optimizer, reason, rec.step)

    def dump(self, reason: str) -> None:
        """Write every optimizer's kept records now."""
        for index, flight in enumerate(self._flights):
            if flight.ring:
                self._dump(index, reason, flight.ring[-1].step)

    def clear(self) -> None:
        """Drop the kept records (recording stopped)."""
        for flight in self._flights:
            flight.ring.clear()

    def _dump(self, index: int, reason: str, trigger_step: int) -> None:
        flight = self._flights[index]
        steps = []
        for rec in flight.ring:
            if rec.step in flight.written:
                continue
            self._writer.write(rec)
            flight.written.append(rec.step)
            steps.append(rec.step)
            self.records_dumped += 1
        flight.ring.clear()
        info = {"optimizer": index, "reason": reason, "trigger_step": trigger_step, "steps": steps,
                "wall_time": time.time()}
        self.dumps.append(info)
        self._writer.add_dump(info)
