"""Per-step summary statistics, computed where the tensors live, with one device-to-host copy per step.

Every function here only launches device work; nothing calls .item()/.cpu() except ``to_host``, which a step's
``read`` calls once per recorded step on the stacked result of all parameters. A step whose tensors hold NaN/Inf
pays one more copy, to count them exactly (see ``count_nonfinite``).

Two sets, two costs (docs/performance.md has the measurements):

* The **lean set** (``LeanStep``, the default at every statistics step): mean, std, norm and NaN/Inf count of each
  parameter, its gradient and its update, so update:data and grad:data. Two reductions per tensor (a sum and a sum
  of squares), the parameter snapshot copied into buffers kept between steps (``SnapshotPool``), the update formed
  in place in them, and every tensor of up to ``SMALL_LIMIT`` elements reduced together, in chunks, from one
  zero-padded float64 store (six ops for all of them, whatever their number); the writer thread makes the table
  (``LeanTables``). That costs less than the hand-written loop it replaces (a
  clone and two ``std()`` per weight) on a transformer and a wide MLP; on a tiny model the recorder's own work per
  step is still 1.2-1.5x the hand loop's (docs/performance.md says where it goes).
* The **full set** (``StepStatistics``, every ``full_stats_every``-th step): also abs max, fractions of exact
  zeros, and the same statistics of every optimizer-state tensor.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Sequence

import numpy as np
import torch

from ..ratios import grad_to_data, update_to_data
from ..runfile.stats_table import StatsRows
from ..statistics import GRAD_TO_DATA, LEAN_COLUMNS, LEAN_KINDS, LEAN_STATS, STATS, UPDATE_TO_DATA
from .snapshots import SPARSE_LAYOUTS, dense, local_part, wait_for_copies

# Statistics of one tensor, in this order (columns "<kind>_<stat>" in the run file).
NONFINITE = STATS.index("nonfinite")

# Below this size the exact two-pass std is cheap; above it the one-pass form (sum and sum of squares) saves two
# passes over memory. One-pass loses precision only when |mean| >> std, which large weight matrices, gradients,
# updates and moments are not (norm-layer scales near 1 are small tensors, so they get the two-pass form).
TWO_PASS_LIMIT = 4096


# The dtypes whose tensors _prepared flattens as they are.
_REAL_FLOATING = frozenset((torch.float64, torch.float32, torch.float16, torch.bfloat16))


def _prepared(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in _REAL_FLOATING and t.layout is torch.strided:  # the usual tensor: one check, not five
        return t.detach().reshape(-1)
    t = t.detach()
    if t.layout in SPARSE_LAYOUTS:  # sparse gradients (nn.Embedding(sparse=True)) and parameters: the statistics
        t = t.to_dense()            # are those of the dense tensor, implicit zeros included, as the run stores it
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        t = t.float()
    return t.reshape(-1)


def element_count(t: torch.Tensor) -> int:
    """How many numbers a tensor's statistics are taken over (a complex element is two, see _prepared)."""
    return t.numel() * (2 if t.is_complex() else 1)


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """(6,) float32 tensor on t's device: mean, std (unbiased), L2 norm, abs max, fraction of exact zeros, and a
    NaN/Inf *flag* (0, or NaN when the tensor holds any NaN/Inf; ``count_nonfinite`` turns flags into counts).

    Four memory passes for a large tensor: sum, sum of squares, min/max, count of non-zeros. torch.std_mean is a
    slow Welford loop on CPU (30x a sum), and an exact NaN count would be two more passes on every step."""
    flat = _prepared(t)
    n = flat.numel()
    if n == 0:
        return torch.full((len(STATS),), float("nan"), device=t.device)
    total = flat.sum(dtype=torch.float32)
    mean = total / n
    if n <= TWO_PASS_LIMIT:
        sq_norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
        std = torch.linalg.vector_norm(flat - mean, dtype=torch.float32) / math.sqrt(n - 1) if n > 1 else \
            torch.full((), float("nan"), device=t.device)
        norm = sq_norm
    else:
        # vector_norm reduces in cascaded blocks (accurate); a BLAS dot would accumulate float32 sequentially.
        norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
        sum_sq = norm * norm
        std = ((sum_sq - n * mean * mean).clamp_min(0) / (n - 1)).sqrt()
    low, high = torch.aminmax(flat)
    absmax = torch.maximum(high.abs(), low.abs()).float()
    zero_frac = (n - torch.count_nonzero(flat)).float() / n
    # NaN propagates into the sum and Inf into min/max: finite sum, min and max mean no NaN/Inf anywhere.
    flag = (total + low.float() + high.float()) * 0.0
    return torch.stack([mean, std.float(), norm, absmax, zero_frac, flag])


@dataclasses.dataclass(frozen=True)
class _BucketPlan:
    """Where ``batched_stats`` puts each tensor of one list of sizes (and zero-count flags): made once per such list
    and device (a recorder's full statistics set sees the same few lists at every such step), so that a call runs no
    index arithmetic of its own."""

    order: list  # the tensors in bucket order
    buckets: list  # (members, width, zeros counted) per bucket, in order
    padded: torch.Tensor  # the zero-padded float64 buffer (the padding is never written: reused call after call)
    slots: list  # each tensor's place in `padded` (a view), in `order`: one foreach copy fills them all
    n: torch.Tensor  # element counts, float64, in `order`
    inverse: torch.Tensor | None  # back to input order; None when `order` is the input's
    no_counts: list  # per bucket: NaN non-zero counts where zeros are not counted (None where they are)

    @classmethod
    def make(cls, counts: np.ndarray, count_zeros: np.ndarray, device: torch.device) -> "_BucketPlan":
        widths = np.full(len(counts), 64, dtype=np.int64)
        while (widths < counts).any():
            widths = np.where(widths < counts, widths * 4, widths)
        buckets = widths * 2 + count_zeros  # a bucket: one width, zeros counted in all of its tensors or in none
        order = np.argsort(buckets, kind="stable")  # bucket by bucket, each in input order
        slots = np.concatenate([[0], np.cumsum(widths[order])])  # each tensor's place in the padded buffer
        in_order = (order == np.arange(len(order))).all()
        planned = [(int((buckets == b).sum()), int(b // 2), bool(b % 2)) for b in np.unique(buckets)]
        padded = torch.zeros(int(slots[-1]), dtype=torch.float64, device=device)
        return cls(order=order.tolist(),
                   buckets=planned,
                   no_counts=[None if zeros else torch.full((members,), float("nan"), dtype=torch.float64,
                                                            device=device) for members, _, zeros in planned],
                   padded=padded,
                   slots=[padded[int(at):int(at) + int(n)] for at, n in zip(slots[:-1], counts[order])],
                   n=torch.from_numpy(counts[order].astype(np.float64)).to(device),
                   inverse=None if in_order else torch.from_numpy(np.argsort(order)).to(device))


_BUCKET_PLANS: dict = {}  # (sizes, zero-count flags, device) -> _BucketPlan, the few most recent
_BUCKET_PLANS_KEPT = 16


def batched_stats(flats: list[torch.Tensor], count_zeros: np.ndarray) -> torch.Tensor:
    """(len, 6) statistics of many small tensors, already flat (``_prepared``), none of them empty, on one device in
    a few ops per width bucket, whatever their number; zero fractions only where `count_zeros` (per tensor) says
    (NaN elsewhere): counting is the slowest of these reductions.

    Per-tensor reductions cost ~10 kernel launches each: on a transformer's biases, norm scales and step counters
    that dispatch overhead, not memory, dominated. The tensors are laid out, zero-padded, in float64 buckets of
    power-of-four widths (one foreach copy for all of them) and each bucket is reduced along its width: sum, sum of
    squares, max and min (abs max) and non-zero count, which zero padding does not change.
    float64 keeps the one-pass std exact where |mean| >> std. (Segment reductions over one concatenation, index_add
    and scatter_reduce, were this function's first form: 3 ms for the 145 tensors of a tiny GPT's full set on the
    CPU.)"""
    device = flats[0].device
    counts = np.fromiter(map(torch.Tensor.numel, flats), dtype=np.int64, count=len(flats))
    key = (counts.tobytes(), count_zeros.tobytes(), device)
    plan = _BUCKET_PLANS.get(key)
    if plan is None:
        if len(_BUCKET_PLANS) >= _BUCKET_PLANS_KEPT:
            del _BUCKET_PLANS[next(iter(_BUCKET_PLANS))]
        plan = _BUCKET_PLANS[key] = _BucketPlan.make(counts, count_zeros, device)
    with torch.no_grad():
        padded = plan.padded
        # A foreach copy into each tensor's slot: a concatenation and an indexed copy into the slots cost 3.5x it
        # (156 against ~45 us for a tiny GPT's 87 gradients and moments).
        torch._foreach_copy_(plan.slots, [flats[i] for i in plan.order])
        sums, squares, lows, highs, nonzero, at = [], [], [], [], [], 0
        for (members, width, zeros), no_count in zip(plan.buckets, plan.no_counts):
            block = padded[at:at + members * width].view(members, width)
            at += members * width
            sums.append(block.sum(1))
            squares.append(torch.linalg.vecdot(block, block, dim=1))  # not norms: a constant tensor's std is 0
            # amin and amax, not aminmax: along a dimension aminmax took 9x their time together on the CPU (243
            # against 27 us for 24 rows of 4096); vector_norm(ord=0) counts non-zeros along it in 0.65x
            # count_nonzero's time; neither changes a number
            lows.append(block.amin(1))
            highs.append(block.amax(1))
            nonzero.append(torch.linalg.vector_norm(block, ord=0, dim=1) if zeros else no_count)
        sums, squares, lows, highs = (torch.cat(x) if len(x) > 1 else x[0] for x in (sums, squares, lows, highs))
        nonzero = torch.cat(nonzero).double() if len(nonzero) > 1 else nonzero[0].double()
        absmax = torch.maximum(highs, -lows)
        n = plan.n
        mean = sums / n
        norms = squares.sqrt()
        std = ((squares - sums * mean).clamp_min(0) / (n - 1)).sqrt()
        std = torch.where(n > 1, std, torch.full_like(std, float("nan")))
        flag = (sums + absmax) * 0.0  # NaN exactly when a tensor holds NaN/Inf
        rows = torch.stack([mean, std, norms, absmax, (n - nonzero) / n, flag], dim=1).float()
        if plan.inverse is not None:
            rows = rows[plan.inverse]
    return rows


def _large_stats(flats: list[torch.Tensor], count_zeros: list[bool]) -> torch.Tensor:
    """(len, 6) for large tensors: four memory passes each (norm, sum, min/max, non-zeros), norms in one foreach
    call, std in the one-pass form (see TWO_PASS_LIMIT)."""
    norms = torch.stack(torch._foreach_norm(flats)).float()
    sums = torch.stack([f.sum(dtype=torch.float32) for f in flats])
    # aminmax over a whole tensor: one pass, 0.7-0.9x amin and amax's two on large tensors (along a dimension it is
    # the other way round: batched_stats)
    lows, highs = zip(*(torch.aminmax(f) for f in flats))
    lows, highs = torch.stack(lows).float(), torch.stack(highs).float()
    n = torch.tensor([f.numel() for f in flats], device=norms.device, dtype=torch.float32)
    # count_nonzero is the slowest pass here (4x a sum on CPU): only for the kinds asked for, NaN elsewhere.
    nonzero = torch.stack([torch.count_nonzero(f).float() if c else torch.full((), float("nan"), device=f.device)
                           for f, c in zip(flats, count_zeros)])
    mean = sums / n
    std = ((norms * norms - n * mean * mean).clamp_min(0) / (n - 1)).sqrt()
    absmax = torch.maximum(lows.abs(), highs.abs())
    flag = (sums + lows + highs) * 0.0
    return torch.stack([mean, std, norms, absmax, (n - nonzero) / n, flag], dim=1)


def stats_rows(tensors: list[torch.Tensor], count_zeros=True) -> torch.Tensor:
    """(len, 6) statistics of a list of tensors, in input order: small ones batched into one concatenation, large
    ones with a few per-tensor reductions. Nothing here waits for the device. count_zeros (a bool, or one per
    tensor) says whose zero fraction to count; the others get NaN."""
    if isinstance(count_zeros, bool):
        count_zeros = [count_zeros] * len(tensors)
    if not tensors:
        return torch.empty(0, len(STATS))
    flats = [_prepared(t) for t in tensors]
    if len({f.device for f in flats}) > 1:  # a model split over devices: one by one, still no sync
        return torch.stack([tensor_stats(t).to(flats[0].device) for t in tensors])
    small = [i for i, f in enumerate(flats) if 0 < f.numel() <= TWO_PASS_LIMIT]
    small_set = set(small)
    large = [i for i, f in enumerate(flats) if i not in small_set and f.numel() > 0]
    empty = [i for i, f in enumerate(flats) if f.numel() == 0]
    blocks, order = [], []
    if large:
        blocks.append(_large_stats([flats[i] for i in large], [count_zeros[i] for i in large]))
        order += large
    if small:
        blocks.append(batched_stats([flats[i] for i in small], np.asarray([count_zeros[i] for i in small], bool)))
        order += small
    if empty:
        blocks.append(torch.full((len(empty), len(STATS)), float("nan"), device=flats[0].device))
        order += empty
    rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    if order != list(range(len(order))):
        inverse = [0] * len(order)
        for position, i in enumerate(order):
            inverse[i] = position
        rows = rows[torch.tensor(inverse, device=rows.device)]
    return rows


def to_host(parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-tensor statistics and bring them to the host: the one synchronisation of a recorded step."""
    if not parts:
        return torch.empty(0, len(STATS))
    parts = [p.reshape(-1, len(STATS)) for p in parts]
    devices = {p.device for p in parts}
    if len(devices) > 1:  # a model split over devices: gather on one first, still one copy to host
        target = parts[0].device
        parts = [p.to(target, non_blocking=True) for p in parts]
    return torch.cat(parts).cpu()


def count_nonfinite(host: np.ndarray, tensors: list) -> None:
    """Replace NaN flags in the host table (a float array, changed in place) by exact NaN/Inf counts, reading only
    the flagged tensors again. Rows whose tensor is no longer available (None) keep NaN: "some, count unknown"."""
    flagged = np.flatnonzero(~np.isfinite(host[:, NONFINITE]))
    if not flagged.size:
        return
    counts = [torch.count_nonzero(~torch.isfinite(_prepared(tensors[i]))).float() if tensors[i] is not None
              else None for i in flagged]
    present = [c for c in counts if c is not None]
    values = iter(torch.stack(present).cpu().tolist()) if present else iter(())
    for i, c in zip(flagged, counts):
        host[i, NONFINITE] = next(values) if c is not None else float("nan")


class StepStatistics:
    """The statistics of one recorded step: launched on the device as the tensors become available (gradients and
    state before the step, when the step would change them; the rest after it), then read with one copy.

    Keys are (parameter name, kind), kind one of "param", "grad", "update", "state.<key>"; ``read`` returns
    {name: {"<kind>_<stat>": value, ..., "update_to_data": ..., "grad_to_data": ...}} in launch order."""

    def __init__(self, zero_counts: Sequence[str]):
        self._zero_counts = tuple(zero_counts)  # kinds whose fraction of exact zeros is counted (see stats_rows)
        self._keys: list[tuple[str, str]] = []
        self._rows: list[torch.Tensor] = []
        self._recount: list = []  # per launch: its tensors, or a function giving them at read time

    def launch(self, keys: list[tuple[str, str]], tensors: list[torch.Tensor],
               recount: Callable[[], list] | None = None) -> None:
        """Launch the statistics of `tensors`. `recount` gives, at read time, the tensors in which a flagged NaN/Inf
        is counted (None for one no longer available); by default these same tensors, held until then."""
        wait_for_copies()  # a full step's statistics read the host copies: they must be there
        self._rows.append(stats_rows(tensors, [kind.split(".")[0] in self._zero_counts for _, kind in keys]))
        self._keys += keys
        self._recount.append(tensors if recount is None else recount)

    def after_step(self, step) -> dict[str, dict[str, float]]:
        """The engine protocol (``engines.StatisticsEngine``): launch what needs the step's result (updates, and at
        a full step the statistics of the CPU copies the record stores), then read everything."""
        keys, tensors, update_keys, updates = [], [], [], []
        for tracked in step.params:
            snap, live = tracked.snapshot, tracked.live  # live: the parameter itself, after the step
            if step.record.full:  # statistics of the CPU copies taken for the full record
                before = snap.param
                kinds = {"param": snap.param, "grad": snap.grad, **{f"state.{k}": v for k, v in snap.state.items()}}
            else:  # the parameter's own statistics were launched before the step, with its gradient's
                before = tracked.before
                kinds = {}
                if step.closure and live.grad is not None:  # step(closure): the gradient of the last call
                    kinds["grad"] = local_part(live.grad)
            for kind, t in kinds.items():
                if t is not None:
                    keys.append((snap.name, kind))
                    tensors.append(t)
            if before is not None:
                after = local_part(live.detach())
                updates.append((dense(after).to("cpu") if step.record.full else after) - before)
                update_keys.append((snap.name, "update"))
        self.launch(keys + update_keys, tensors + updates)  # one batched call; the keys' order is the columns'
        return self.read()

    def read(self) -> StatsRows:
        """Everything launched, on the host, with update:data and grad:data per parameter: a table of the parameters
        and ``<kind>_<stat>`` columns of every kind launched (NaN where a parameter has no such tensor)."""
        host = to_host(self._rows).double().numpy()
        sources = []
        for recount in self._recount:
            sources += recount() if callable(recount) else recount
        count_nonfinite(host, sources)
        names = list(dict.fromkeys(name for name, _ in self._keys))
        kinds = list(dict.fromkeys(kind for _, kind in self._keys))
        name_at = {name: i for i, name in enumerate(names)}
        kind_at = {kind: i for i, kind in enumerate(kinds)}
        values = np.full((len(names), len(kinds), len(STATS)), np.nan)
        values[[name_at[name] for name, _ in self._keys], [kind_at[kind] for _, kind in self._keys]] = host
        std = STATS.index("std")

        def stds(kind):
            return values[:, kind_at[kind], std] if kind in kind_at else np.full(len(names), np.nan)
        table = np.empty((len(names), len(kinds) * len(STATS) + 2))
        table[:, :-2] = values.reshape(len(names), -1)
        with np.errstate(invalid="ignore", divide="ignore"):
            table[:, -2] = update_to_data(stds("update"), stds("param"))
            table[:, -1] = grad_to_data(stds("grad"), stds("param"))
        columns = tuple(f"{kind}_{stat}" for kind in kinds for stat in STATS) + (UPDATE_TO_DATA, GRAD_TO_DATA)
        return StatsRows(names, columns, table)


# -- the lean set: the default at every statistics step ------------------------------------------------------------

_SHAPE = operator.attrgetter("shape")

# Small tensors are reduced in chunks of this many elements (SnapshotPool), then each tensor's chunks added up.
CHUNK = 64

# Tensors of up to this many elements are reduced together from one flat buffer: a per-tensor reduction would cost
# its dispatch (a few microseconds) and not its bytes. Larger ones get their own sum and norm, each in one pass.
SMALL_LIMIT = 4096


def lean_applies(params: list[torch.Tensor], grads: list) -> bool:
    """Whether the lean set can take these tensors (local parts): dense real floating-point parameters with dense
    gradients, all on one device. Anything else (sparse or complex tensors, a model split over devices, a step
    without a gradient) gets the full set's general path."""
    if not params:
        return False
    device = params[0].device
    for p, g in zip(params, grads):
        if g is None or p.layout in SPARSE_LAYOUTS or g.layout in SPARSE_LAYOUTS or not p.is_floating_point() \
                or not g.is_floating_point() or p.device != device or g.device != device or g.shape != p.shape:
            return False
    return True


class SnapshotPool:
    """The buffers one optimizer's lean statistics reuse from step to step, so that no step allocates (a fresh clone
    per tensor and step cost page faults and allocator work as well as the copy):

    * small tensors (up to SMALL_LIMIT elements) live in one zero-padded float64 (3, width) buffer (``store``), each
      at a CHUNK-aligned place: row 0 holds each parameter before the step, row 1 its gradient, row 2 its value
      after the step, which one subtraction turns into before - after. The first two rows are filled by one foreach
      copy before the step, the third by one after it; then one sum and one sum of squares over the (3, chunks,
      CHUNK) view reduce everything, and one indexed addition adds each tensor's chunks up, straight into the step's
      host buffer (``small_host``). On a small model the cost of a step is its number of ops more than their bytes:
      this is six, whatever the number of tensors. float64 keeps the one-pass std exact where |mean| >> std (norm-layer
      scales near 1 are small tensors) and the update exact (the difference of two float32 numbers is a float64
      one); reducing float64 data was also faster than reducing float32 data with a float64 accumulator
      (docs/performance.md);
    * each large parameter gets a snapshot buffer of its own dtype.

    Rebuilt when the parameters change (add_param_group, a swapped tensor, a new shape). Holds one copy of the
    recorded parameters for the recorder's lifetime. Everything a step needs that depends only on the layout (the
    views, index arrays, element counts) is made here, once, so that a step runs no per-parameter Python beyond
    handing the tensors to a few batched ops."""

    def __init__(self):
        self.key = None
        self._live = None  # the list `live` the pool was last laid out for (a track's LeanPlan passes the same one)

    def layout(self, live: list[torch.Tensor], params: list[torch.Tensor]) -> "SnapshotPool":
        # A parameter keeps its identity when `.data` is swapped for another shape: the shapes are compared always,
        # the identities only when the list is not the one laid out for last.
        shapes = list(map(_SHAPE, params))
        if live is self._live and shapes == self.key[1]:
            return self
        key = (list(map(id, live)), shapes)
        if key == self.key:
            self._live = live
            return self
        device = params[0].device
        sizes = [p.numel() for p in params]
        self.small = [i for i, n in enumerate(sizes) if n <= SMALL_LIMIT]
        # each small tensor at a CHUNK-aligned place of the store, zero-padded to whole chunks (an empty one gets a
        # chunk of zeros too, so that every tensor owns a chunk)
        chunks = np.array([max(1, -(-sizes[i] // CHUNK)) for i in self.small], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        self.store = torch.zeros((len(LEAN_KINDS), int(starts[-1]) * CHUNK), dtype=torch.float64, device=device)
        self.blocks = self.store.view(len(LEAN_KINDS), int(starts[-1]), CHUNK)
        # (sums, sums of squares) x (parameters, gradients, before - after) x chunks, then x tensors: each tensor's
        # chunks added up by one indexed addition (``chunk_owner``: a chunk's tensor; a product with a 0/1 matrix
        # would spread one tensor's NaN to all), the small tensors' part of a step's one host copy (the writer
        # thread adding chunks up for a batch cost it ~20 us a row)
        self.chunk_sums = torch.zeros((2 * len(LEAN_KINDS), int(starts[-1])), dtype=torch.float64, device=device)
        self.chunk_owner = torch.from_numpy(np.repeat(np.arange(len(self.small)), chunks)).to(device)
        self.no_sums = torch.zeros((2 * len(LEAN_KINDS), len(self.small)), dtype=torch.float64, device=device)
        self.small_host = torch.zeros((2, len(LEAN_KINDS), len(self.small)), dtype=torch.float64, device=device)
        self.param_views, self.grad_views, self.after_views = [], [], []
        for j, i in enumerate(self.small):
            at = int(starts[j]) * CHUNK
            for views, kind in ((self.param_views, 0), (self.grad_views, 1), (self.after_views, 2)):
                views.append(self.store[kind, at:at + sizes[i]].view(params[i].shape))
        # the views and lists a step hands to its ops, made once
        self.before_views = self.param_views + self.grad_views  # one foreach copy before the step
        self.all_small = len(self.small) == len(sizes)
        self.before_row, self.update_row = self.store[0], self.store[2]
        self.chunk_sums_out, self.chunk_squares_out = self.chunk_sums.view(2, len(LEAN_KINDS), -1).unbind(0)
        self.small_host_out = self.small_host.view(2 * len(LEAN_KINDS), -1)
        # Last parameter first: the optimizer steps the first parameter first, so before the step the last tensors
        # this pool read are the first the optimizer reads; after it, the first read here the last it wrote.
        self.large = [i for i, n in reversed(list(enumerate(sizes))) if n > SMALL_LIMIT]
        self.buffers = [torch.empty(params[i].shape, dtype=params[i].dtype, device=device) for i in self.large]
        n = np.asarray(sizes, dtype=np.float64)
        with np.errstate(divide="ignore"):
            self.tables = LeanTables(
                small=np.asarray(self.small, dtype=np.intp),
                large=np.asarray(self.large, dtype=np.intp),
                inverse_n=np.where(n > 0, 1 / n, np.nan),  # an empty tensor's statistics are NaN
                inverse_n_1=np.where(n > 1, 1 / (n - 1), np.nan),  # the unbiased std of one number too
                empty=(n == 0) if (n == 0).any() else None)
        self.key, self._live = key, live
        return self


class LeanStep:
    """The lean statistics of one step: ``LeanStep(pool, names, live, params, grads)`` before the step copies the
    parameters and gradients into the pool (and launches the large tensors' reductions); ``read()`` after it copies
    the new values in, forms the updates, reduces everything and brings it to the host in one copy. Same result
    shape as ``StepStatistics.read``. `params` are the tensors to reduce: `live` itself, or its local parts
    (DTensor). After ``read``, ``grad_norm`` is the total norm of `grads` (a float, from the gradients' sums of
    squares in the step's host copy: no pass of its own).

    ``grads=None``: a ``step(closure)`` (LBFGS, Lightning's automatic optimization), whose gradient exists only inside
    the step. Only the parameters are copied before it; the gradients' statistics are taken after it, from the
    gradients the last closure call left (as for the full set), and the parameters' from their snapshot, which holds
    the values before the step until the update is formed. ``grad_norm`` is then None: the step's total norm is taken
    when the closure is first evaluated. A parameter the closure left without a gradient gets NaN gradient
    statistics (the optimizer skipped it: its update is zero)."""

    def __init__(self, pool: SnapshotPool, names: list[str], live: list[torch.Tensor], params: list[torch.Tensor],
                 grads: list[torch.Tensor] | None):
        self.names = names
        self.live = live  # the parameters themselves: their values after the step give the update
        self.params = params
        self.grads = grads
        self.pool = pool = pool.layout(live, params)
        self.large_before = None  # the large tensors' reductions before the step
        self.no_grad = None  # a step(closure): the parameters the closure left without a gradient
        self.closure = grads is None
        self.grad_norm = None
        with torch.no_grad():  # the hooks run outside the optimizer's no_grad: no autograd bookkeeping here
            if grads is None:
                if pool.small:
                    torch._foreach_copy_(pool.param_views, [params[i] for i in pool.small])
                for buffer, i in zip(pool.buffers, pool.large):
                    buffer.copy_(params[i])
                return
            if pool.all_small:  # one op for every parameter and gradient
                torch._foreach_copy_(pool.before_views, params + grads)
            elif pool.small:
                small = pool.small
                torch._foreach_copy_(pool.before_views, [params[i] for i in small] + [grads[i] for i in small])
            self._reduce_large_before(params, grads, params_copied=False)

    def _copy_grads(self, grads: list[torch.Tensor]) -> None:
        if self.pool.small:
            torch._foreach_copy_(self.pool.grad_views, [grads[i] for i in self.pool.small])

    def _reduce_large_before(self, params: list[torch.Tensor], grads: list[torch.Tensor], params_copied: bool) -> None:
        """The large parameters' and gradients' reductions (and, unless `params_copied`, the parameters' copies)."""
        reductions = []
        for buffer, i in zip(self.pool.buffers, self.pool.large):
            g = grads[i]
            if params_copied:
                p = buffer  # the values before the step, until the update is formed in it
            else:
                p = params[i]
                buffer.copy_(p)
            # Each tensor's passes run back to back, while it is still in the cache.
            pa, ga = _accumulation(p), _accumulation(g)
            reductions += [p.sum(dtype=pa), torch.linalg.vector_norm(p, dtype=pa),
                           g.sum(dtype=ga), torch.linalg.vector_norm(g, dtype=ga)]
        if reductions:
            self.large_before = torch.stack(reductions)

    def _after(self) -> list[torch.Tensor]:
        if self.params is self.live:
            return self.live
        return [local_part(q.detach()) for q in self.live]

    def after_step(self, step) -> StatsRows:
        """The engine protocol: what needs the step's result, ``read`` launches and reads with the rest."""
        return self.read()

    def read(self) -> StatsRows:
        parts = self.launch_after()
        if not parts:
            return self.rows(np.zeros(0))
        with torch.no_grad():  # the one synchronisation of the step
            own = len(parts) > 1
            host = (torch.cat([p.double().reshape(-1) for p in parts]) if own else parts[0].reshape(-1)).cpu().numpy()
        # this step's own numbers: on the CPU, .cpu() gave the pool's buffer itself, which the next step refills
        return self.rows(host if own or parts[0].device.type != "cpu" else host.copy())

    def rows(self, host: np.ndarray) -> StatsRows:
        """The result of ``read`` from the host copy of ``launch_after``'s tensors (concatenated, float64, this
        step's own), and ``grad_norm``. The table is made later, where it is first read (the writer thread), from
        these numbers alone; where one is NaN or infinite, now, with the exact NaN/Inf counts only the tensors can
        give."""
        pool = self.pool
        values = host.tolist()  # Python's sums of so few numbers cost less than numpy's
        if self.grads is not None and not self.closure:
            self.grad_norm = pool.tables.grad_norm(values)
        tables = pool.tables if not self.no_grad else LeanTables.without_gradients(pool.tables, self.no_grad)
        if math.isfinite(sum(values)):  # NaN and Inf propagate into the sum
            return StatsRows(self.names, LEAN_COLUMNS, maker=tables, numbers=host)
        return StatsRows(self.names, LEAN_COLUMNS, tables.tables(host[None], self._count_nonfinite)[0])

    def launch_after(self) -> list[torch.Tensor]:
        """After the step: form the updates and launch every reduction. Returns the device tensors whose
        concatenation ``rows`` reads (a caller may copy them to the host together with its own)."""
        pool, large = self.pool, self.pool.large
        with torch.no_grad():
            if self.grads is None:
                self._take_closure_gradients()
            after = self._after()
            parts = []
            if pool.small:
                torch._foreach_copy_(pool.after_views, after if pool.all_small else [after[i] for i in pool.small])
                # The new values become before - after = -update, in place: the sign is undone on the host.
                torch.sub(pool.before_row, pool.update_row, out=pool.update_row)
                torch.sum(pool.blocks, 2, out=pool.chunk_sums_out)
                # sums of squares, not norms: a constant tensor's (a norm-layer scale at its init) std is exactly 0
                torch.linalg.vecdot(pool.blocks, pool.blocks, dim=2, out=pool.chunk_squares_out)
                torch.index_add(pool.no_sums, 1, pool.chunk_owner, pool.chunk_sums, out=pool.small_host_out)
                parts.append(pool.small_host)
            reductions = []
            for buffer, i in zip(pool.buffers, large):
                buffer.sub_(after[i])
                acc = _accumulation(buffer)
                reductions += [buffer.sum(dtype=acc), torch.linalg.vector_norm(buffer, dtype=acc)]
            if reductions:
                parts += [self.large_before, torch.stack(reductions)]
        return parts

    def _take_closure_gradients(self) -> None:
        """A step(closure)'s gradients, as the last closure call left them, copied or reduced now (see the class
        docstring)."""
        grads = [q.grad for q in self.live]
        self.no_grad = [i for i, (p, g) in enumerate(zip(self.params, grads))
                        if g is None or not lean_applies([p], [g])]
        for i in self.no_grad:  # reduced as zeros, shown as NaN (LeanTables.no_grad)
            grads[i] = torch.zeros_like(self.params[i])
        self.grads = grads
        self._copy_grads(grads)
        self._reduce_large_before(self.params, grads, params_copied=True)

    def _count_nonfinite(self, flagged: np.ndarray, counts: np.ndarray) -> None:
        """Exact NaN/Inf counts of the flagged tensors ((LEAN_KINDS, P) masks, into `counts`), the rare path: one more
        host copy. A parameter is counted after the step (its values before it are gone: the snapshot now holds the
        update); its update from the snapshot; its gradient as it is."""
        pool = self.pool
        small_position = {i: j for j, i in enumerate(pool.small)}
        large_position = {i: j for j, i in enumerate(pool.large)}
        after = self._after()
        tensors, targets = [], []
        for k, i in zip(*np.nonzero(flagged)):
            kind = LEAN_KINDS[k]
            if kind == "param":
                t = after[i]
            elif kind == "grad":
                t = self.grads[i]
            else:
                t = pool.after_views[small_position[i]] if i in small_position else pool.buffers[large_position[i]]
            tensors.append(torch.count_nonzero(~torch.isfinite(t)))
            targets.append((k, i))
        for (k, i), c in zip(targets, torch.stack(tensors).cpu().tolist()):
            counts[k, i] = float(c)


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity (fill_tables)
class LeanTables:
    """What turns lean steps' host numbers into their tables (the ``maker`` of their ``StatsRows``): where each
    tensor's numbers are (among the small tensors' or the large ones') and the tensors' element counts. Made with
    the pool's layout and never changed: a table made on the writer thread after the pool has moved on reads its
    own step's."""

    small: np.ndarray  # which parameters are small, in the store's order
    large: np.ndarray  # which are large, in LeanStep's order
    inverse_n: np.ndarray  # 1 / elements (NaN for an empty tensor)
    inverse_n_1: np.ndarray  # 1 / (elements - 1) (NaN for fewer than two)
    empty: np.ndarray | None  # which tensors are empty; None when none is
    no_grad: tuple = ()  # the parameters a step(closure) left without a gradient: NaN gradient statistics

    @classmethod
    def without_gradients(cls, tables: "LeanTables", no_grad: list) -> "LeanTables":
        return dataclasses.replace(tables, no_grad=tuple(no_grad))

    def sums_and_squares(self, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(steps, LEAN_KINDS, P) sums and sums of squares of every tensor, from (steps, n) host copies: the small
        tensors' as the device added their chunks up, the large tensors' norms squared."""
        steps, count = numbers.shape[0], len(self.inverse_n)
        if not len(self.large):  # every tensor small, in the store's order: the numbers are the tables' layout
            small = numbers.reshape(steps, 2, len(LEAN_KINDS), count)
            return small[:, 0].copy(), small[:, 1]
        sums, squares = np.zeros((steps, len(LEAN_KINDS), count)), np.zeros((steps, len(LEAN_KINDS), count))
        at = 0
        if len(self.small):
            at = 2 * len(LEAN_KINDS) * len(self.small)
            small = numbers[:, :at].reshape(steps, 2, len(LEAN_KINDS), len(self.small))
            sums[:, :, self.small] = small[:, 0]
            squares[:, :, self.small] = small[:, 1]
        if len(self.large):
            before = numbers[:, at:at + 4 * len(self.large)].reshape(steps, len(self.large), 2, 2)  # (p, g) x (s, n)
            after = numbers[:, at + 4 * len(self.large):].reshape(steps, len(self.large), 2)
            sums[:, :2, self.large] = before[:, :, :, 0].swapaxes(1, 2)
            squares[:, :2, self.large] = before[:, :, :, 1].swapaxes(1, 2) ** 2
            sums[:, 2, self.large] = after[:, :, 0]
            squares[:, 2, self.large] = after[:, :, 1] ** 2
        return sums, squares

    def grad_norm(self, values: list) -> float:
        """The total norm of a step's gradients from its host numbers (as ``sums_and_squares`` reads them, here one
        step's, as a list: Python's sums of so few numbers cost less than numpy's): the small gradients' sums of
        squares and the large ones' norms."""
        small, large, kinds = len(self.small), len(self.large), len(LEAN_KINDS)
        at = (kinds + _GRAD) * small  # the small tensors' (sums, sums of squares) x kinds x tensors
        squares = sum(values[at:at + small])
        at = 2 * kinds * small  # then per large tensor (parameter, gradient) x (sum, norm)
        return math.sqrt(squares + sum([n * n for n in values[at + 3:at + 4 * large:4]]))

    def tables(self, numbers: np.ndarray, count_nonfinite: Callable | None = None) -> np.ndarray:
        """(steps, P, len(LEAN_COLUMNS)) tables, from (steps, n) host copies of lean steps (each the sums and sums
        of squares, or norms, of every parameter, gradient and before - after, ``sums_and_squares``): each
        parameter's lean statistics and its two ratios.
        `count_nonfinite(flagged, counts)` fills exact NaN/Inf counts of the flagged (LEAN_KINDS, P) tensors of a
        one-step stack; without it there is none (the caller checked)."""
        steps, count = numbers.shape[0], len(self.inverse_n)
        sums, squares = self.sums_and_squares(numbers)
        sums[:, _UPDATE] *= -1  # the update's: reduced from before - after
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            norms = np.sqrt(squares)
            mean = sums * self.inverse_n
            std = np.sqrt(np.maximum(squares - sums * mean, 0.0) * self.inverse_n_1)
            table = np.zeros((steps, len(LEAN_COLUMNS), count))
            stats = table[:, :len(LEAN_KINDS) * len(LEAN_STATS)].reshape(steps, len(LEAN_KINDS), len(LEAN_STATS),
                                                                         count)
            stats[:, :, _MEAN] = mean
            stats[:, :, _STD] = std
            stats[:, :, _NORM] = norms
            if self.empty is not None:
                stats[..., self.empty] = np.nan
            if count_nonfinite is not None:
                # NaN propagates into the sum and Inf into the sum of squares: both finite means no NaN/Inf
                # anywhere (but for a float32 overflow of the norm, which the exact count then clears).
                flagged = ~np.isfinite(sums[0] + squares[0])
                if self.empty is not None:
                    flagged[:, self.empty] = False
                if flagged.any():
                    count_nonfinite(flagged, stats[0, :, _NONFINITE])
            table[:, _UPDATE_TO_DATA] = update_to_data(std[:, _UPDATE], std[:, _PARAM])
            table[:, _GRAD_TO_DATA] = grad_to_data(std[:, _GRAD], std[:, _PARAM])
            if self.no_grad:
                no_grad = list(self.no_grad)
                stats[:, _GRAD, :, no_grad] = np.nan
                table[:, _GRAD_TO_DATA, no_grad] = np.nan
        return table.swapaxes(1, 2)


# Where LeanStep's table puts each statistic and kind (LEAN_STATS, LEAN_KINDS, LEAN_COLUMNS).
_MEAN, _STD, _NORM, _NONFINITE = (LEAN_STATS.index(s) for s in ("mean", "std", "norm", "nonfinite"))
_PARAM, _GRAD, _UPDATE = (LEAN_KINDS.index(k) for k in ("param", "grad", "update"))
_UPDATE_TO_DATA, _GRAD_TO_DATA = LEAN_COLUMNS.index(UPDATE_TO_DATA), LEAN_COLUMNS.index(GRAD_TO_DATA)


def _accumulation(t: torch.Tensor) -> torch.dtype:
    """The dtype a large tensor's sum and norm accumulate in: float32, or float64 for a float64 tensor
    (vector_norm refuses to narrow)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
