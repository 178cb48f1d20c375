"""Replay one parameter's recorded history block by block, so that verify's memory is bounded by a block, never by
a parameter, and its speed by the CPU cache, not by main memory.

Most optimizers are elementwise: each element's new value depends on that element of the parameter, gradient and
state and on scalars (lr, the step's bias corrections). Their replay can then run on any part of a tensor, and
verify runs it on parts of two sizes:

- a *block* (at most ``runfile.tensor_blocks.BLOCK_ELEMENTS`` elements of one row, a contiguous range that HDF5 reads as one
  hyperslab) bounds memory: a 200 MB parameter is read and replayed a block at a time, and several rows of a small
  parameter are read at once (one HDF5 call per dataset instead of one per row);
- a *chunk* (``CHUNK_ELEMENTS``) is what one call of the rule sees: small enough that the rule's float64
  temporaries stay in the CPU's cache, which makes the replay several times faster than on whole tensors.

The tolerance of a parameter's check is relative to the largest replayed update of the whole tensor (engine.py), so
a parameter that spans several blocks is replayed twice: a first pass finds those maxima, a second compares. A
parameter within one block (most of them) is replayed once.

Rules that read more than the elements they update are registered as such (registry.py): ``needs_whole_tensor``
(norms, factored moments, matrix products: Muon, Adafactor, LBFGS) get the whole tensor, in its shape;
``needs_whole_rows`` (SparseAdam: a row of the gradient is present or not) get blocks of whole rows along the first
dimension. A rule with a state entry shaped neither like the parameter nor as a scalar gets the whole tensor too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..runfile import schema
from ..runfile.errors import RunFileError
from . import hparams
from .registry import STEP_KEY, NotReplayable, ReplayRuleError, UnusableRecord

# Elements per call of an elementwise rule: its float64 temporaries (a dozen of 256 KB) stay in a 1 MB L2 cache.
CHUNK_ELEMENTS = 1 << 15


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN (both in the stored dtype)."""
    if torch.equal(a, b):
        return True
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def largest(t: torch.Tensor) -> float:
    """The largest finite magnitude in t (0 for an empty tensor): the scale tolerances are relative to."""
    if not t.numel():
        return 0.0
    value = float(t.abs().max())
    if math.isfinite(value):
        return value
    return float(t.abs().nan_to_num(posinf=0.0).max())


def compare_parts(replayed: torch.Tensor, recorded: torch.Tensor, scale: float, *, eps: float, ulps: float,
                  rtol: float) -> tuple[float, float]:
    """(max abs error, max error/tolerance) of replayed against recorded (float64, same shape), the tolerance as
    engine.tolerance: ulps * eps * |recorded| + rtol * scale. Equal infinities and NaN against NaN agree."""
    if replayed.numel() == 0:
        return 0.0, 0.0
    finite_scale = scale if math.isfinite(scale) else 0.0
    err = torch.sub(replayed, recorded).abs_()
    tol = recorded.abs().mul_(ulps * eps).add_(rtol * finite_scale + 1e-30)
    max_err = float(err.max())
    ratio = float(err.div_(tol).max())
    if math.isfinite(max_err) and math.isfinite(ratio):
        return max_err, ratio
    # Non-finite values somewhere: the careful definition (engine.elementwise_error and engine.tolerance).
    same = (replayed == recorded) | (torch.isnan(replayed) & torch.isnan(recorded))
    err = torch.where(same, torch.zeros((), dtype=replayed.dtype),
                      torch.nan_to_num((replayed - recorded).abs(), nan=float("inf")))
    tol = ulps * eps * recorded.abs().nan_to_num(posinf=0.0) + rtol * finite_scale + 1e-30
    return float(err.max()), float((err / tol).max())


def resolved_counts(update: torch.Tensor, recorded: torch.Tensor, scale: float, *, eps: float, ulps: float,
                    rtol: float) -> tuple[int, int]:
    """(moving, resolved): elements whose replayed update is finite and non-zero, and among them those whose update
    is larger than their tolerance, i.e. where a missing (or doubled) update would have been caught."""
    size = update.abs()
    finite_scale = scale if math.isfinite(scale) else 0.0
    tol = recorded.abs().nan_to_num(posinf=0.0).mul_(ulps * eps).add_(rtol * finite_scale + 1e-30)
    finite = size < math.inf
    return int(((size > 0) & finite).sum()), int(((size > tol) & finite).sum())


@dataclass
class Tolerance:
    eps: float  # spacing of the stored dtype
    ulps: float
    rtol: float


@dataclass
class RowResult:
    """What the blocks of one (step, parameter) check add up to."""

    scale: float = 0.0  # largest replayed update
    recorded_scale: float = 0.0  # largest recorded update
    state_scales: dict = field(default_factory=dict)  # largest value of each recorded next-step state entry
    max_abs_err: float = 0.0
    err_to_tol: float = 0.0
    state_err_to_tol: float | None = None
    continuous: bool = True
    moving: int = 0
    resolved: int = 0
    skip_note: str | None = None  # the rule raised NotReplayable
    explanation: str | None = None  # why the first mismatching block mismatched (explain.py), if found
    explained: bool = False


@dataclass
class RowInputs:
    """One row of one block, in the stored dtype: the step's inputs, what was recorded after it, and the next
    step's record when there is one."""

    before: torch.Tensor
    grad: torch.Tensor
    after: torch.Tensor
    state: dict
    next_before: torch.Tensor | None
    next_state: dict | None


def _float64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.double()


def run_rule(rule, before, grad, state, group, step, where: str, path: str):
    """rule.replay with its failures sorted: NotReplayable passes through, the file's fault becomes RunFileError,
    anything else ReplayRuleError naming the rule."""
    try:
        return rule.replay(before, grad, state, group, step)
    except (NotReplayable, RunFileError):
        raise
    except UnusableRecord as exc:
        raise RunFileError(f"{path}: {where}: {exc} (replay rule {rule.function_name})") from exc
    except Exception as exc:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ReplayRuleError(f"{path}: replay rule {rule.function_name} (for {rule.name}) failed on "
                              f"{where}: {message[:300]}") from exc


def replay_chunks(rule, inputs: RowInputs, elementwise_keys: set, group: dict, step: int, chunk: int | None,
                  where: str, path: str):
    """Replay one row of one block: (replayed param, replayed state, largest replayed update), float64, flat when
    chunked.

    chunk=None: one call on the block as it is shaped (rules that need whole tensors or rows). Otherwise the flat
    block is replayed `chunk` elements per call; state entries in `elementwise_keys` are cut like the parameter,
    the others (scalars such as ASGD's eta) passed whole."""
    if chunk is None or inputs.before.numel() <= chunk:
        flat = chunk is not None
        shape_of = (lambda t: t.reshape(-1)) if flat else (lambda t: t)
        before = _float64(shape_of(inputs.before))
        state = {k: _float64(shape_of(v) if k in elementwise_keys else v) for k, v in inputs.state.items()}
        out = run_rule(rule, before, _float64(shape_of(inputs.grad)), state, group, step, where, path)
        return out.param, out.state, largest(out.param - before)
    before, grad = inputs.before.reshape(-1), inputs.grad.reshape(-1)
    size = before.numel()
    flat_state = {k: (v.reshape(-1) if k in elementwise_keys else v) for k, v in inputs.state.items()}
    param_out = torch.empty(size, dtype=torch.float64)
    state_out: dict = {}
    cut: set = set()  # replayed state entries shaped like the parameter's chunk: assembled; others: first chunk's
    scale = 0.0
    for lo in range(0, size, chunk):
        part = slice(lo, min(lo + chunk, size))
        state = {k: _float64(v[part] if k in elementwise_keys else v) for k, v in flat_state.items()}
        start = before[part].double()
        out = run_rule(rule, start, grad[part].double(), state, group, step, where, path)
        param_out[part] = out.param
        scale = max(scale, largest(out.param - start))
        for key, value in out.state.items():
            if lo == 0:
                if value.shape == out.param.shape:
                    cut.add(key)
                    state_out[key] = torch.empty(size, dtype=torch.float64)
                else:
                    state_out[key] = value
            if key in cut:
                state_out[key][part] = value
    return param_out, state_out, scale


def state_scales(result: RowResult, inputs: RowInputs) -> None:
    """Fold the largest value of each next-step state entry of this block into the row (their tolerance scale)."""
    for key, value in (inputs.next_state or {}).items():
        result.state_scales[key] = max(result.state_scales.get(key, 0.0), largest(value))


def _compare_param(replayed: torch.Tensor, before: torch.Tensor, after: torch.Tensor, scale: float,
                   tol: Tolerance) -> tuple[float, float, float, int, int]:
    """(max abs error, max error/tolerance, largest recorded update, moving, resolved) of one flat float64 part:
    compare_parts and resolved_counts in one pass over the part."""
    finite_scale = scale if math.isfinite(scale) else 0.0
    bound = after.abs().mul_(tol.ulps * tol.eps).add_(tol.rtol * finite_scale + 1e-30)
    err = torch.sub(replayed, after).abs_()
    max_err = float(err.max())
    ratio = float(err.div_(bound).max())
    recorded = float(torch.sub(after, before).abs_().max())
    if not (math.isfinite(max_err) and math.isfinite(ratio) and math.isfinite(recorded)):
        max_err, ratio = compare_parts(replayed, after, scale, eps=tol.eps, ulps=tol.ulps, rtol=tol.rtol)
        moving, resolved = resolved_counts(replayed - before, after, scale, eps=tol.eps, ulps=tol.ulps, rtol=tol.rtol)
        return max_err, ratio, largest(after - before), moving, resolved
    size = torch.sub(replayed, before).abs_()
    return max_err, ratio, recorded, int((size > 0).sum()), int((size > bound).sum())


def compare_block(result: RowResult, inputs: RowInputs, replayed_param: torch.Tensor, replayed_state: dict,
                  tol: Tolerance, chunk: int | None, shape_conflict) -> None:
    """Compare one block's replay with the record, against the row's scales (result.scale, state_scales), and
    fold the errors into the row. Raises RunFileError (through shape_conflict) for a state of another shape."""
    after, before = inputs.after.reshape(-1), inputs.before.reshape(-1)
    flat = replayed_param.reshape(-1)
    size = flat.numel()
    step = size if chunk is None or size == 0 else chunk
    for lo in range(0, max(size, 1), step):
        part = slice(lo, lo + step)
        err, ratio, recorded, moving, resolved = _compare_param(flat[part], _float64(before[part]),
                                                                _float64(after[part]), result.scale, tol)
        result.max_abs_err = max(result.max_abs_err, err)
        result.err_to_tol = max(result.err_to_tol, ratio)
        result.recorded_scale = max(result.recorded_scale, recorded)
        result.moving += moving
        result.resolved += resolved
    if inputs.next_before is not None and result.continuous:
        result.continuous = identical(inputs.next_before, inputs.after)
    if inputs.next_state is None:
        return
    conflict = shape_conflict(inputs.next_state, replayed_state, flat=chunk is not None)
    if conflict:
        raise RunFileError(conflict)
    for key, value in replayed_state.items():
        if key not in inputs.next_state:
            continue
        value, recorded = value.reshape(-1), inputs.next_state[key].reshape(-1)
        n = value.numel()
        part_size = max(n, 1) if chunk is None else chunk
        ratio = 0.0
        for lo in range(0, max(n, 1), part_size):
            part = slice(lo, lo + part_size)
            ratio = max(ratio, compare_parts(value[part], _float64(recorded[part]), result.state_scales.get(key, 0.0),
                                             eps=tol.eps, ulps=tol.ulps, rtol=tol.rtol)[1])
        result.state_err_to_tol = ratio if result.state_err_to_tol is None else max(result.state_err_to_tol, ratio)


class Tile:
    """Rows [start, stop) of one element block of a parameter, read at once in the stored dtype (one HDF5 read per
    dataset), with the state presence mask."""

    def __init__(self, p, rows: slice, index: tuple, state_keys: list, elementwise_keys: set, path: str):
        self.p, self.start = p, rows.start
        self.before = p.read_part(schema.KIND_PARAM, rows, index)
        self.grad = p.read_part(schema.KIND_GRAD, rows, index)
        self.after = p.read_part(schema.KIND_PARAM_AFTER, rows, index)
        self.present = p.state_present(rows) if state_keys else np.zeros((rows.stop - rows.start, 0), bool)
        self.state = {}
        self._path = path
        self.state_keys = state_keys
        for i, key in enumerate(state_keys):
            if self.present[:, i].any():
                self.state[key] = self._read_state(key, rows, index if key in elementwise_keys else ())

    def _read_state(self, key, rows, index):
        try:
            values = self.p.read_part(f"{schema.STATE_GROUP}/{key}", rows, index)
        except RunFileError:
            if key not in self.p._group[schema.STATE_GROUP]:
                raise RunFileError(f"{self._path}: state {key!r} of parameter {self.p.name!r} (optimizer "
                                   f"{self.p.optimizer.index}) is marked present but has no dataset") from None
            raise
        if key == STEP_KEY:  # every step counter enters the replay here: checked before a rule sees one
            counters = values.detach().double().cpu().numpy().reshape(values.shape[0], -1)
            present = self.present[:counters.shape[0], self.state_keys.index(key)]
            steps = self.p.optimizer.steps
            try:
                hparams.check_step_counters(counters[present], int(np.max(steps)) if len(steps) else 0)
            except hparams.BadHyperparameter as exc:
                raise RunFileError(f"{self._path}: parameter {self.p.name!r} (optimizer {self.p.optimizer.index}): "
                                   f"{exc}") from None
        return values

    def state_at(self, row: int) -> dict:
        i = row - self.start
        out = {}
        for k, key in enumerate(self.state_keys):
            if self.present[i, k]:
                values = self.state[key]
                if i >= values.shape[0]:
                    raise RunFileError(f"{self._path}: state {key!r} of parameter {self.p.name!r} (optimizer "
                                       f"{self.p.optimizer.index}) is marked present at row {row} but has only "
                                       f"{values.shape[0] + self.start} rows")
                out[key] = values[i]
        return out
