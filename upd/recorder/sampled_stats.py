"""The lean statistics estimated from a fixed sample of each large tensor's elements: ``upd.record(stats_sample=K)``.

The exact lean set (``device_stats.LeanStep``) reads every element of every parameter and gradient several times per
step: a copy, a sum and a norm of each before the step, a subtraction, a sum and a norm after it. Eager CPU torch
cannot fuse those passes, so on a model whose step is short for its size they cost more than users accept at every
step. Here a tensor of more than K elements is represented by K fixed element positions, chosen once per parameter
layout from a seeded generator: only those are copied before the step and read again after it, so the per-step cost
no longer grows with the tensor (docs/performance.md has the cost and the estimator's error on real runs).

What stays exact, because it is cheap and matters:

* tensors of at most K elements: the exact lean path, bit for bit (biases, norm scales, small layers);
* each large gradient's norm, from one ``_foreach_norm`` pass over the large gradients: the step's total gradient
  norm (the clipping check compares it with the norm when backward ended: an estimate would report false
  clipping), each gradient's ``grad_norm``, and its NaN/Inf flag (NaN and Inf propagate into a norm);
* a large gradient's std, nearly: from the exact norm and the sample's mean, std**2 = (norm**2 - n mean**2)/(n-1),
  whose error comes only from the mean's (relative error of the variance ~ 2|mean|/std/sqrt(K) + 1/K, against
  ~ sqrt(2/K) for a sample's std, and far less than that on heavy-tailed gradients such as an embedding's). Where
  the sample says |mean| > std the sample's own std is used instead.

Estimated from the sample: the mean, std and norm (sqrt(n/K) times the sample's) of the parameter and of the update,
the gradient's mean, and the NaN/Inf flags of the parameter and the update (a NaN outside the sample is not seen
there; it reaches the gradients, whose flag is exact, at the next step). A flagged update's count is NaN ("some,
count unknown"): only its sample exists.

The positions are single elements (``BLOCK`` = 1). Blocks of contiguous elements gather faster (a cache line
each rather than an element), but neighbours in a weight matrix's row share their row's scale: blocks of 16 doubled
the worst error on the wide MLP for under 1 ms less CPU time per step on the reference transformer (measured in
docs/performance.md). K is rounded down to a multiple of BLOCK.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..ratios import GRAD_TO_DATA, UPDATE_TO_DATA, grad_to_data, update_to_data
from ..runfile.stats_table import StatsRows
from ..statistics import LEAN_COLUMNS, LEAN_KINDS, LEAN_STATS
from .device_stats import LeanStep, SnapshotPool

BLOCK = 1  # contiguous elements per sampled block (see the module docstring)
# Whose norms one _foreach_norm pass takes exactly, before the step: the gradient's (see the docstring). Adding
# "param" makes grad:data nearly exact too, for one more pass over the parameters (docs/performance.md: not worth it).
EXACT_NORMS = ("grad",)
SEED = 20261201  # the positions are a function of the layout alone: the same in every run of the same model


def sample_positions(n: int, sample: int, block: int = BLOCK, key: tuple = ()) -> np.ndarray:
    """Sorted element positions (of a tensor of n > sample elements, in row-major order) that stand for it: sample //
    block blocks of `block` contiguous elements at distinct block-aligned offsets, drawn from a generator seeded by
    SEED and `key`. The last n % block elements are never drawn."""
    rng = np.random.default_rng([SEED, n, *key])
    starts = np.sort(rng.choice(n // block, sample // block, replace=False)) * block
    return (starts[:, None] + np.arange(block)).ravel()


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(len,) float64 L2 norms, one _foreach_norm per dtype; half-precision tensors accumulated in float32."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for at, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(at)
    groups = [(at, torch.stack(torch._foreach_norm([tensors[a] for a in at], 2,
                                                     dtype=torch.float32 if torch.finfo(dtype).bits < 32 else None)))
              for dtype, at in by_dtype.items()]
    if len(groups) == 1:
        return groups[0][1].double()
    out = torch.empty(len(tensors), dtype=torch.float64, device=tensors[0].device)
    for at, norms in groups:
        out[at] = norms.double()
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)  # a view for the usual contiguous tensor


class SampledPool:
    """What sampled lean steps keep between steps: the exact lean path's pool for the tensors of at most `sample`
    elements, and for the larger ones their sample positions and a (3, count, K) buffer per dtype whose rows hold a
    tensor's sampled parameter (row 0), gradient (row 1) and, after the step, new parameter values (row 2)."""

    def __init__(self, sample: int, block: int | None = None, exact_norms: tuple = EXACT_NORMS):
        self.sample, self.block = sample, BLOCK if block is None else block
        self.exact_norms = exact_norms  # the kinds whose norms are taken exactly, in this order
        self.key = None

    def layout(self, live: list[torch.Tensor], params: list[torch.Tensor]) -> "SampledPool":
        key = [(id(q), p.shape, p.dtype) for q, p in zip(live, params)]
        if key == self.key:
            return self
        sizes = [p.numel() for p in params]
        self.exact = [i for i, n in enumerate(sizes) if n <= self.sample]
        self.exact_pool = SnapshotPool()
        self.sampled = [i for i, n in enumerate(sizes) if n > self.sample]
        device = params[0].device
        self.positions = [torch.from_numpy(sample_positions(sizes[i], self.sample, self.block, (j,))).to(device)
                          for j, i in enumerate(self.sampled)]
        self.k = (self.sample // self.block) * self.block
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, i in enumerate(self.sampled):
            by_dtype.setdefault(params[i].dtype, []).append(j)
        self.buffers, self.rows, order = [], [None] * len(self.sampled), []
        for dtype, members in by_dtype.items():
            buffer = torch.empty((3, len(members), self.k), dtype=dtype, device=device)
            self.buffers.append(buffer)
            for row, j in enumerate(members):
                self.rows[j] = (buffer[0, row], buffer[1, row], buffer[2, row])
            order += members
        self.order = np.argsort(np.asarray(order, dtype=np.intp))  # buffer row order -> sampled order
        self.numel = np.asarray([sizes[i] for i in self.sampled], dtype=np.float64)
        self.key = key
        return self


class SampledStep:
    """``LeanStep``'s counterpart: ``SampledStep(pool, names, live, grads)`` before the step copies the samples and
    launches the exact parts; ``read()`` after it gathers the samples again and brings everything to the host in one
    copy. Same result shape as ``LeanStep.read`` (LEAN_COLUMNS), same ``grad_norm`` (exact)."""

    def __init__(self, pool: SampledPool, names: list[str], live: list[torch.Tensor], grads: list[torch.Tensor]):
        self.names, self.live, self.grads = names, live, grads
        self.pool = pool = pool.layout(live, live)
        exact = pool.exact
        self.exact = LeanStep(pool.exact_pool, [names[i] for i in exact], [live[i] for i in exact],
                              [live[i] for i in exact], [grads[i] for i in exact]) if exact else None
        with torch.no_grad():
            for (param_row, grad_row, _), i, positions in zip(pool.rows, pool.sampled, pool.positions):
                torch.index_select(_flat(live[i]), 0, positions, out=param_row)
                if grads[i].dtype == grad_row.dtype:
                    torch.index_select(_flat(grads[i]), 0, positions, out=grad_row)
                else:  # a gradient of another dtype than its parameter's (out= takes one dtype)
                    grad_row.copy_(torch.index_select(_flat(grads[i]), 0, positions))
            self.exact_norms = None
            if pool.sampled:
                tensors = {"param": live, "grad": grads}
                self.exact_norms = _norms([tensors[kind][i].detach() for kind in pool.exact_norms
                                           for i in pool.sampled])
        self.grad_norm = None  # after read: the total norm of `grads` (exact), a float

    def after_step(self, step) -> StatsRows:
        """The engine protocol: everything was launched before the step."""
        return self.read()

    def read(self) -> StatsRows:
        pool = self.pool
        with torch.no_grad():
            parts = self.exact.launch_after() if self.exact is not None else []
            exact_length = sum(p.numel() for p in parts)
            if pool.sampled:
                for (_, _, after_row), i, positions in zip(pool.rows, pool.sampled, pool.positions):
                    torch.index_select(_flat(self.live[i]), 0, positions, out=after_row)
                sums, squares = [], []
                for buffer in pool.buffers:
                    x = buffer.double()
                    x[2] = x[0] - x[2]  # before - after = -update, exact in float64
                    sums.append(x.sum(2))
                    squares.append((x * x).sum(2))
                parts += [torch.cat(sums, 1), torch.cat(squares, 1), self.exact_norms]
            # the one synchronisation of the step
            host = torch.cat([p.double().reshape(-1) for p in parts]).cpu().numpy() if parts else np.zeros(0)
        table = np.empty((len(self.names), len(LEAN_COLUMNS)))
        if self.exact is not None:
            table[pool.exact] = self.exact.rows(host[:exact_length]).table
        if pool.sampled:
            table[pool.sampled] = self._table(host[exact_length:])
        # the total gradient norm from the exact parts' norms in the host copy
        squares = self.exact.grad_norm ** 2 if self.exact is not None else 0.0
        if pool.sampled:
            grad_norms = self._exact_norms(host[exact_length:])[pool.exact_norms.index("grad")]
            squares += float(np.sum(grad_norms ** 2))
        self.grad_norm = math.sqrt(squares)
        return StatsRows(self.names, LEAN_COLUMNS, table)  # read as LeanStep's: {name: {column: value}}

    def _table(self, host: np.ndarray) -> np.ndarray:
        """(sampled, len(LEAN_COLUMNS)) rows of the sampled tensors, from their part of the host copy."""
        pool = self.pool
        count, k, n = len(pool.sampled), pool.k, pool.numel
        sums, squares = host[:2 * len(LEAN_KINDS) * count].reshape(2, len(LEAN_KINDS), count)[:, :, pool.order]
        exact_norms = self._exact_norms(host)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            mean = sums / k
            variance = np.maximum(squares - sums * mean, 0.0) / (k - 1)  # the sample's, unbiased
            norm = np.sqrt(squares * (n / k))
            flagged = ~np.isfinite(sums + squares)
            for kind, exact_norm in zip(pool.exact_norms, exact_norms):
                # The std from the exact norm and the sample's mean, where that is the better estimate.
                row = LEAN_KINDS.index(kind)
                from_norm = np.maximum(exact_norm * exact_norm - n * mean[row] ** 2, 0.0) / (n - 1)
                variance[row] = np.where(mean[row] ** 2 <= variance[row], from_norm, variance[row])
                norm[row] = exact_norm
                flagged[row] |= ~np.isfinite(exact_norm)
            grad, update = LEAN_KINDS.index("grad"), LEAN_KINDS.index("update")
            mean[update] *= -1  # reduced from before - after
            std = np.sqrt(variance)
            table = np.zeros((len(LEAN_COLUMNS), count))
            stats = table[:len(LEAN_KINDS) * len(LEAN_STATS)].reshape(len(LEAN_KINDS), len(LEAN_STATS), count)
            stats[:, LEAN_STATS.index("mean")] = mean
            stats[:, LEAN_STATS.index("std")] = std
            stats[:, LEAN_STATS.index("norm")] = norm
            if flagged.any():
                self._count_nonfinite(flagged, stats[:, LEAN_STATS.index("nonfinite")])
            table[LEAN_COLUMNS.index(UPDATE_TO_DATA)] = update_to_data(std[update], std[LEAN_KINDS.index("param")])
            table[LEAN_COLUMNS.index(GRAD_TO_DATA)] = grad_to_data(std[grad], std[LEAN_KINDS.index("param")])
        return table.T

    def _exact_norms(self, host: np.ndarray) -> np.ndarray:
        """(kinds of pool.exact_norms, sampled) exact norms, from the sampled tensors' part of the host copy (after
        their sums and sums of squares)."""
        count = len(self.pool.sampled)
        return host[2 * len(LEAN_KINDS) * count:].reshape(len(self.pool.exact_norms), count)

    def _count_nonfinite(self, flagged: np.ndarray, counts: np.ndarray) -> None:
        """Exact NaN/Inf counts of flagged parameters (after the step, as LeanStep counts them) and gradients, in one
        more host copy; a flagged update gets NaN: only its sample exists."""
        tensors, targets = [], []
        for kind, j in zip(*np.nonzero(flagged)):
            i = self.pool.sampled[j]
            if LEAN_KINDS[kind] == "update":
                counts[kind, j] = np.nan
                continue
            t = self.live[i] if LEAN_KINDS[kind] == "param" else self.grads[i]
            tensors.append(torch.count_nonzero(~torch.isfinite(t.detach())))
            targets.append((kind, j))
        if tensors:
            for (kind, j), c in zip(targets, torch.stack(tensors).cpu().tolist()):
                counts[kind, j] = float(c)
