"""Live statistics (for the sinks) of a job whose ranks each hold a part of the model (FSDP2 shards, ZeRO partitions).

A shard's update:data ratio is not its parameter's, so no rank can write the parameter's scalars from its own
statistics. At each statistics step every recording rank adds the sufficient statistics of its parts (element count,
sum, spread, sum of squares: the merge rules of ``upd.statistics``) into one small float64 tensor, in a
parameter order every rank derives alike from the job's optimizers; ONE all-reduce (a sum) combines them, and rank 0
turns the sums into the whole tensors' stds and norms, then the ratios (``upd.ratios``), and writes them. Nothing
else is communicated, and without live sinks (``sinks=``, ``tensorboard=``) none of this runs.

The all-reduce sits in the optimizer's post-step hook, so it must never hang training. Every rank counts the
optimizer's steps itself, from the step counter in the optimizer's state onwards, whatever happens to its recorder,
and joins at the same statistics steps. A rank whose recording stopped (an error, not a crash) joins once more with
zeros and a flag saying so; every rank reads the flags from the same all-reduced tensor, so all stop joining
together at that step, and rank 0 says which ranks stopped. A failed all-reduce stops this rank's joining (its peers'
all-reduce fails too). Pure functions on numpy arrays, then ``JobScalars``, the only part that communicates.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..ratios import grad_to_data, update_to_data
from ..sinks.base import SinkStep
from ..statistics import (ABSMAX, GRAD, GRAD_TO_DATA, LEAN_KINDS, LIVE_COLUMNS, MEAN, NONFINITE, NORM, PARAM, STATS,
                          STD, UPDATE, UPDATE_TO_DATA, ZERO_FRAC, column, finish, sufficient)

# The tensors whose statistics the sinks' LIVE_COLUMNS are made of (ratios and norms of these, nothing else).
KINDS = LEAN_KINDS
# What a rank adds per parameter and kind, summed over ranks (a rank holding no part adds zeros): element count,
# sum, the part's own spread m2 = std^2 (n - 1), "between" = n mean^2, and the sum of squares. Summed, "between" minus
# sum^2 / n is the spread of the parts' means around the whole's (Chan et al.'s term), kept apart from m2 so that
# |mean| >> std loses no digits.
FIELDS = ("n", "sum", "m2", "between", "sumsq")


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the all-reduced tensor: the same on every rank."""

    name: str  # as the sinks get it (the recorder passes the recorded name: the SinkStep says which optimizer)
    recorded: str  # as the recorder names it in its statistics


def _per_count(counts: np.ndarray, width: int, rows_of: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """(P, width): rows_of(count, mask) for each distinct positive count, zeros elsewhere.

    ``shard_stats`` takes one element count at a time (its arrays run over steps); here the arrays run over
    parameters, and a model's parameters come in few distinct sizes."""
    out = np.zeros((len(counts), width))
    for count in np.unique(counts[counts > 0]):
        mask = counts == count
        out[mask] = rows_of(int(count), mask)
    return out


def summable(counts, stats: dict) -> np.ndarray:
    """(P, len(FIELDS)): what a rank adds for P parts of one kind, from their recorded statistics.

    counts: (P,) elements each part's statistics were taken over (0: not this rank's to add). stats: {stat: (P,)}
    with the names of ``upd.statistics.STATS``; a NaN statistic of a counted part makes the sums NaN, as a NaN/Inf
    makes the whole tensor's statistics NaN."""
    counts = np.asarray(counts, dtype=np.int64)
    stats = {k: np.asarray(v, dtype=np.float64) for k, v in stats.items()}

    def rows_of(count, mask):
        s = sufficient(count, {k: v[mask] for k, v in stats.items()})
        n = np.full(int(mask.sum()), s["n"])
        return np.stack([n, s[MEAN] * n, s[STD], s[MEAN] * s[MEAN] * n, s[NORM]], axis=1)
    return _per_count(counts, len(FIELDS), rows_of)


def whole(totals: np.ndarray) -> dict:
    """{"std": (P,), "norm": (P,)} of the whole tensors from the all-reduced (P, len(FIELDS)) sums."""
    totals = np.asarray(totals, dtype=np.float64)
    n, total, m2, between, sumsq = (totals[:, FIELDS.index(f)] for f in FIELDS)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / n
        # The parts' own spreads plus that of their means around the whole's mean (>= 0 but for rounding).
        spread = m2 + np.maximum(between - total * mean, 0.0)

    def rows_of(count, mask):
        done = finish({"n": float(count), MEAN: mean[mask], STD: spread[mask], NORM: sumsq[mask],
                       ABSMAX: np.nan, ZERO_FRAC: np.nan, NONFINITE: np.nan}, int(mask.sum()))
        return np.stack([done[STD], done[NORM]], axis=1)
    counted = n.astype(np.int64)
    out = _per_count(counted, 2, rows_of)
    out[counted == 0] = np.nan  # no element anywhere: no statistic (finish says the same for n = 0)
    return {"std": out[:, 0], "norm": out[:, 1]}


def contribution(slots: list[Slot], parts: dict) -> np.ndarray:
    """(len(slots) * len(KINDS) * len(FIELDS),) this rank's sums. parts: {recorded name: (count, {"<kind>_<stat>":
    value})} of the parts this rank adds (a parameter it holds no part of, or not its to add, is absent)."""
    block = np.zeros((len(slots), len(KINDS), len(FIELDS)))
    counts = np.array([parts[s.recorded][0] if s.recorded in parts else 0 for s in slots], dtype=np.int64)
    for k, kind in enumerate(KINDS):
        stats = {stat: [parts[s.recorded][1].get(f"{kind}_{stat}", np.nan) if s.recorded in parts else np.nan
                        for s in slots] for stat in STATS}
        block[:, k, :] = summable(counts, stats)
    return block.reshape(-1)


def scalars(slots: list[Slot], summed: np.ndarray) -> dict[str, dict[str, float]]:
    """{slot name: {column of LIVE_COLUMNS: value}} of the whole parameters, from the all-reduced sums."""
    block = np.asarray(summed, dtype=np.float64).reshape(len(slots), len(KINDS), len(FIELDS))
    kinds = {kind: whole(block[:, k, :]) for k, kind in enumerate(KINDS)}
    columns = {UPDATE_TO_DATA: update_to_data(kinds[UPDATE]["std"], kinds[PARAM]["std"]),
               GRAD_TO_DATA: grad_to_data(kinds[GRAD]["std"], kinds[PARAM]["std"]),
               **{column(kind, NORM): kinds[kind]["norm"] for kind in KINDS}}
    return {slot.name: {column: float(columns[column][i]) for column in LIVE_COLUMNS} for i, slot in enumerate(slots)}


def sink_steps(opt_index: int, rows: list, combined: tuple | None) -> list[SinkStep]:
    """What rank 0's sinks get after a step of optimizer `opt_index`: the scalar rows read to the host so far
    (`rows`, [(step, wall_time, {name: value})]), and when the step was a statistics step every rank contributed to
    (`combined`, from ``JobScalars.after_step``) the whole parameters' statistics, with that step's scalars."""
    steps = [SinkStep(optimizer=opt_index, step=step, wall_time=wall, scalars=values) for step, wall, values in rows]
    if combined is not None:
        step, slots, summed = combined
        own = [s for s in steps if s.step == step]
        steps = [s for s in steps if s.step != step]
        values = {name: value for s in own for name, value in s.scalars.items()}
        steps.append(SinkStep(optimizer=opt_index, step=step, wall_time=own[0].wall_time if own else time.time(),
                              params=scalars(slots, summed), scalars=values))
    return steps


def collective_device() -> torch.device:
    """A device the default process group all-reduces on: the CPU when its backend takes CPU tensors (gloo, mpi, or
    "cpu:gloo,cuda:nccl"), else the current accelerator (NCCL takes CUDA tensors only)."""
    backend = str(torch.distributed.get_backend()).lower()
    if backend in ("gloo", "mpi") or "cpu:" in backend:
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type, accelerator.current_device_index())
    return torch.device("cuda", torch.cuda.current_device())


class JobScalars:
    """One rank's side of the job's live scalars: counts the optimizers' steps, joins one all-reduce per statistics
    step, and on rank 0 returns the whole parameters' scalars to write.

    slots_of(optimizer index) gives that optimizer's slots now (the same on every rank, in the same order); warn(why)
    tells the user once, when the scalars stop."""

    def __init__(self, rank: int, world_size: int, stats_every: int, initial_steps: list[int],
                 slots_of: Callable[[int], list[Slot]], warn: Callable[[str], None]):
        self.rank = rank
        self.world_size = world_size
        self.stats_every = stats_every
        self.steps = list(initial_steps)
        self.slots_of = slots_of
        self.warn = warn
        self.stopped: str | None = None  # why this rank joins no more
        self.all_reduces = 0
        self._device: torch.device | None = None

    def after_step(self, opt_index: int, step_parts: tuple[int, dict] | None) -> tuple | None:
        """Called on every rank after every step of optimizer `opt_index`. step_parts: (recorded step, parts for
        ``contribution``) when this rank recorded the step's statistics, None when it did not (its recording
        stopped). Returns (step, slots, summed values for ``scalars``) on rank 0 when the step is a statistics step
        every rank contributed to, else None. Raises nothing: a failure is a flag in the all-reduce, or a stop."""
        step = self.steps[opt_index]
        self.steps[opt_index] += 1
        if self.stopped or step % self.stats_every:
            return None
        try:
            slots = self.slots_of(opt_index)
        except Exception as exc:  # the same parameters on every rank: every rank stops here alike
            return self._stop(f"the parameters to combine could not be listed ({type(exc).__name__}: {exc})", True)
        flags = np.zeros(self.world_size)
        values = np.zeros(len(slots) * len(KINDS) * len(FIELDS))
        if step_parts is not None and step_parts[0] == step:
            try:
                values = contribution(slots, step_parts[1])
                flags[self.rank] = 1.0
            except Exception:  # the flag says so: this rank's part is missing, and every rank stops below
                values = np.zeros(len(slots) * len(KINDS) * len(FIELDS))
        try:
            summed = self._all_reduce(np.concatenate([flags, values]))
        except Exception as exc:
            return self._stop(f"the all-reduce combining the ranks' statistics failed ({type(exc).__name__}: "
                              f"{exc})", True)
        missing = [r for r in range(self.world_size) if summed[r] != 1.0]
        if missing:
            return self._stop(f"recording stopped on rank{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))} at step {step}", self.rank == 0)
        return (step, slots, summed[self.world_size:]) if self.rank == 0 else None

    def _all_reduce(self, values: np.ndarray) -> np.ndarray:
        if self._device is None:
            self._device = collective_device()
        buffer = torch.from_numpy(values).to(self._device)
        torch.distributed.all_reduce(buffer)  # looked up at each call (tests count the calls)
        self.all_reduces += 1
        return buffer.cpu().numpy()

    def _stop(self, why: str, tell: bool) -> None:
        self.stopped = why
        if tell:
            self.warn(why)
        return None
