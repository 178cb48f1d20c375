"""Reading a distributed job: the files its ranks wrote, presented as one run with the reader API of ``Run``.

Each recording rank of a ``torch.distributed`` job writes its own file, named from the job's path
(``runfile.ranks``), so no rank ever waits on another. Whatever reads the job (``upd.open_run(path)``, every CLI
command, ``upd.analyze``, ``upd.verify``) must see the model the user trained, not a rank's slice of it; this
module puts the slices back together, lazily, and only here:

- each logical parameter appears once, in one of three layouts: *sharded* (every rank holds a part, recorded with
  its ``offset`` into ``global_shape`` and its ``part_layout``: a box of the tensor under FSDP2, a run of its
  flattened elements under DeepSpeed ZeRO and FSDP1; reads are stitched from every rank's part), a
  *partition* (ZeRO: one rank holds it whole) or *replicated* (several ranks hold it whole, DDP with
  ``ranks="all"``: rank 0's copy is read, the others stay reachable through ``holders`` for the replica check);
- records are aligned by optimizer step: the job holds the steps every rank file committed (a rank killed mid-run
  leaves the job readable up to the last step all files completed; ``missing_ranks`` says which ranks lack which);
- statistics of sharded parameters are combined exactly from the per-shard statistics (``runfile.shard_stats``).

Problems that make a job unreadable as a whole (a missing rank file, files of two world sizes, shards that do not
tile their tensor) are RunFileErrors naming the rank and the file.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .shard_stats import ShardCombiner
from . import schema
from .errors import RunFileError
from .ranks import rank_files, rank_path
from .validate import shape_problem
from .ratio_table import ratios_table
from .reader import (DEFAULT_BLOCK_BYTES, DUMP_COLUMNS, EVENT_COLUMNS, PARAMS_COLUMNS, ParamHistory, ParamRecord,
                     Run, RunReader, clip_rows, describe_optimizer, param_entries, params_row, steps_table)
from .stats_table import in_model_order, stats_param_meta

__all__ = ["Job", "JobOptimizer", "JobParam", "ParamLayout", "is_job_path", "param_layout",
           "SHARDED", "PARTITION", "REPLICATED"]

SHARDED, PARTITION, REPLICATED = "sharded", "partition", "replicated"
# Meta keys of a DTensor parameter the reader uses (record.ShardLayout's fields; "shape" stays the stored part's).
GLOBAL_SHAPE, OFFSET = "global_shape", "offset"


def is_job_path(path) -> bool:
    """Whether rank files exist for `path` (those of several world sizes included: opening them says why not)."""
    try:
        return bool(rank_files(path)[1])
    except ValueError:
        return True


# -- layouts: pure functions of the parameters' metadata ---------------------------------------------------------
@dataclass(frozen=True)
class ParamLayout:
    """How one logical parameter is spread over the ranks that hold it."""

    layout: str  # SHARDED, PARTITION or REPLICATED
    shape: tuple  # the logical tensor's shape
    # rank -> (offset, shard shape) of each holder, in the space the parts tile (`tiled_shape`); a whole copy is
    # the box at offset 0
    boxes: dict
    readers: tuple  # the ranks whose boxes are read: one per distinct non-empty box, the lowest rank
    part_layout: str = schema.PART_BOX  # how a sharded parameter's parts sit in it (schema.PART_LAYOUTS)

    @property
    def tiled_shape(self) -> tuple:
        """The shape the parts tile: the tensor's for boxes, its element count for flat runs (row-major)."""
        if self.part_layout == schema.PART_FLAT:
            return (math.prod(self.shape),)  # Python integers: never wraps
        return self.shape

    def whole(self, parts: dict, dtype, rows: int | None = None) -> torch.Tensor:
        """The whole tensor (with a leading dimension of `rows` when given) from {rank: its part}."""
        lead = () if rows is None else (rows,)
        out = torch.empty((*lead, *self.tiled_shape), dtype=dtype)
        for r, part in parts.items():
            offset, local = self.boxes[r]
            out[(*(slice(None) for _ in lead), *(slice(o, o + s) for o, s in zip(offset, local)))] = part
        return out.reshape(*lead, *self.shape)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.boxes)

    def count(self, rank: int) -> int:
        """Elements rank `rank` holds."""
        return int(np.prod(self.boxes[rank][1])) if self.boxes[rank][1] else 1


def _int_list(value, length: int | None = None) -> tuple | None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                       for v in value):
        return None
    if length is not None and len(value) != length:
        return None
    return tuple(value)


def _dtype_conflict(param, what: str, rank: int, found, expected) -> str:
    return (f"{param.holders[rank].optimizer.run.path}: {what} of parameter {param.name!r} is stored as "
            f"{str(found).replace('torch.', '')} on rank {rank}, {str(expected).replace('torch.', '')} on rank "
            f"{param._readers[0]}: the shards of one tensor must agree")


def tiling_problem(shape: tuple, boxes: list[tuple[tuple, tuple]]) -> str | None:
    """Why the boxes (offset, shape) do not tile a tensor of `shape` exactly once, or None. Empty boxes are ignored;
    identical boxes count once (replicated shards, HSDP)."""
    distinct = sorted({b for b in boxes if all(s > 0 for s in b[1])})
    total = int(np.prod(shape)) if shape else 1
    if not distinct:
        return None if total == 0 else f"no rank holds any of its {total} elements"
    start = np.array([b[0] for b in distinct], dtype=np.int64).reshape(len(distinct), len(shape))
    stop = start + np.array([b[1] for b in distinct], dtype=np.int64).reshape(len(distinct), len(shape))
    if (stop > np.array(shape, dtype=np.int64)).any():
        return "a shard reaches past the tensor's global shape"
    overlap = ((start[:, None, :] < stop[None, :, :]) & (start[None, :, :] < stop[:, None, :])).all(axis=2)
    np.fill_diagonal(overlap, False)
    if overlap.any():
        return "two different shards overlap"
    covered = int(np.prod(stop - start, axis=1).sum())
    if covered != total:
        return f"the shards hold {covered} of its {total} elements"
    return None


def param_layout(metas: dict, parallelism: str | None = None) -> ParamLayout:
    """The layout of one logical parameter from the metadata each holding rank recorded for it ({rank: meta}).

    ValueError says what is inconsistent. A parameter with a global shape (a DTensor) is sharded; one held whole by
    several ranks is replicated, as is one held by a single rank of replicated training; else it is a partition."""
    ranks = sorted(metas)
    sharded = [r for r in ranks if GLOBAL_SHAPE in metas[r]]
    if sharded:
        if len(sharded) < len(ranks):
            raise ValueError(f"ranks {_ranks_text(sharded)} recorded it as a part of a distributed tensor, ranks "
                             f"{_ranks_text(sorted(set(ranks) - set(sharded)))} as a plain tensor")
        shapes = {_int_list(metas[r][GLOBAL_SHAPE]) for r in ranks}
        if None in shapes or len(shapes) > 1:
            raise ValueError(f"its ranks recorded different or malformed global shapes "
                             f"({', '.join(str(metas[r][GLOBAL_SHAPE])[:40] for r in ranks)})")
        shape = shapes.pop()
        problem = shape_problem(list(shape))  # Python integers: [2**61 + 6, 8] must not wrap to 48 elements
        if problem:
            raise ValueError(f"its global {problem}")
        kinds = {metas[r].get(schema.PART_LAYOUT, schema.PART_BOX) for r in ranks}
        if len(kinds) > 1 or not kinds <= set(schema.PART_LAYOUTS):
            raise ValueError(f"its ranks recorded different or unknown part layouts "
                             f"({', '.join(str(metas[r].get(schema.PART_LAYOUT))[:20] for r in ranks)})")
        part_layout = kinds.pop()
        tiled = ParamLayout(SHARDED, shape, {}, (), part_layout).tiled_shape
        boxes = {}
        for r in ranks:
            local = _int_list(metas[r].get("shape"), len(tiled))
            offset = _int_list(metas[r].get(OFFSET), len(tiled))
            if local is None or offset is None or any(o + n > g for o, n, g in zip(offset, local, tiled)):
                raise ValueError(f"rank {r} recorded a shard shape {str(metas[r].get('shape'))[:40]} or offset "
                                 f"{str(metas[r].get(OFFSET))[:40]} that does not fit its global shape {list(shape)}"
                                 + (" as a flat run" if part_layout == schema.PART_FLAT else ""))
            boxes[r] = (offset, local)
        problem = tiling_problem(tiled, list(boxes.values()))
        if problem:
            raise ValueError(f"its shards on ranks {_ranks_text(ranks)} do not tile its global shape "
                             f"{list(shape)}: {problem}")
        readers, seen = [], set()
        for r in ranks:
            if all(s > 0 for s in boxes[r][1]) and boxes[r] not in seen:
                seen.add(boxes[r])
                readers.append(r)
        return ParamLayout(SHARDED, shape, boxes, tuple(readers), part_layout)
    shapes = {tuple(metas[r].get("shape") or ()) for r in ranks}
    if len(shapes) > 1:
        raise ValueError(f"ranks {_ranks_text(ranks)} hold it whole with different shapes "
                         f"({', '.join(str(list(s)) for s in sorted(shapes))})")
    shape = shapes.pop()
    whole = {r: ((0,) * len(shape), shape) for r in ranks}
    layout = REPLICATED if len(ranks) > 1 or parallelism in schema.WHOLE_ON_EVERY_RANK else PARTITION
    return ParamLayout(layout, shape, whole, (ranks[0],))


def _ranks_text(ranks) -> str:
    return ",".join(map(str, ranks))


def common_steps(step_arrays: list) -> np.ndarray:
    """The steps every array holds, sorted."""
    if not step_arrays:
        return np.zeros(0, np.int64)
    common = np.unique(np.asarray(step_arrays[0], dtype=np.int64))
    for steps in step_arrays[1:]:
        common = np.intersect1d(common, np.asarray(steps, dtype=np.int64))
    return common


def positions(steps: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Index in `steps` of each step of `wanted` (all present; the first occurrence of a repeated step)."""
    steps = np.asarray(steps, dtype=np.int64)
    order = np.argsort(steps, kind="stable")
    return order[np.searchsorted(steps[order], np.asarray(wanted, dtype=np.int64))].astype(np.intp)


def step_ranges(steps) -> list[list[int]]:
    """Sorted steps as [first, last] runs of consecutive steps: [[3, 5], [9, 9]] for 3, 4, 5, 9."""
    out: list[list[int]] = []
    for s in sorted(int(x) for x in steps):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _as_index(rows: np.ndarray):
    """Rank rows as ParamRecord.read takes them: a slice when contiguous (one HDF5 hyperslab), else the array."""
    if not len(rows):
        return slice(0, 0)
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


# -- the reader objects ------------------------------------------------------------------------------------------
class JobParam(ParamHistory):
    """One logical parameter of a job's optimizer: the ParamRecord API, reading from the ranks that hold it.

    ``holders``: {rank: that rank's ParamRecord}. A sharded parameter is stitched on read from one holder per
    distinct shard; a partition or replicated one is read from its lowest holding rank."""

    def __init__(self, optimizer: "JobOptimizer", name: str, layout: ParamLayout, holders: dict):
        self.optimizer = optimizer
        self.name = name
        self.layout = layout.layout
        self.holders: dict[int, ParamRecord] = dict(sorted(holders.items()))
        self._layout = layout
        self._readers = [r for r in layout.readers if r in self.holders] or [min(self.holders)]
        first = self.holders[self._readers[0]]
        self.meta = {k: v for k, v in first.meta.items() if k != OFFSET}
        self.meta["shape"] = list(layout.shape)
        self.shape = tuple(layout.shape)
        self.dtype = first.dtype
        self.param_group = first.param_group
        if self.layout == SHARDED:  # one tensor: its shards are stored alike, or stitching would cast one silently
            for kind in schema.TENSOR_KINDS:
                stored = {r: self.holders[r].storage_dtype(kind) for r in self._readers}
                if len(set(stored.values())) > 1:
                    r = next(r for r in self._readers if stored[r] != stored[self._readers[0]])
                    raise RunFileError(_dtype_conflict(self, repr(kind), r, stored[r], stored[self._readers[0]]))
        # Rows: the job's records (steps every rank committed) at which every rank read holds this parameter.
        job_steps = optimizer.steps
        present = np.ones(len(job_steps), dtype=bool)
        rank_steps = {}
        for r in self._readers:
            rec = self.holders[r]
            rank_steps[r] = optimizer.rank_optimizers[r].steps[rec.records]
            present &= np.isin(job_steps, rank_steps[r])
        self.records = np.nonzero(present)[0].astype(np.int64)
        self._rank_rows = {r: positions(rank_steps[r], job_steps[self.records]) for r in self._readers}

    @property
    def ranks(self) -> list[int]:
        """The ranks that hold (part of) this parameter."""
        return list(self.holders)

    @property
    def shards(self) -> dict:
        """{rank: (offset, shape)} of each holder's part (a whole copy is the part at offset 0)."""
        return {r: self._layout.boxes[r] for r in self.holders}

    @property
    def num_rows(self) -> int:
        return len(self.records)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def kinds(self) -> list[str]:
        return [k for k in schema.TENSOR_KINDS if all(k in self.holders[r].kinds for r in self._readers)]

    @property
    def state_keys(self) -> list[str]:
        return list(dict.fromkeys(k for r in self._readers for k in self.holders[r].state_keys))

    def storage_dtype(self, kind: str = schema.KIND_PARAM) -> str | None:
        return self.holders[self._readers[0]].storage_dtype(kind)

    def read(self, kind: str, rows=slice(None)) -> torch.Tensor:
        """The whole tensor of kind ('param', 'grad', 'param_after') at the given row(s), as ParamRecord.read; a
        sharded parameter is stitched from its shards here, reading only those rows."""
        index = clip_rows(rows, self.num_rows, self.name)
        single = isinstance(index, int)
        job_rows = np.arange(self.num_rows)[index] if not single else np.array([index])
        if self.layout != SHARDED:
            r = self._readers[0]
            rank_rows = self._rank_rows[r][job_rows]
            return self.holders[r].read(kind, int(rank_rows[0]) if single else _as_index(rank_rows))
        parts = {}
        for r in self._readers:
            local = self._layout.boxes[r][1]
            part = self.holders[r].read(kind, _as_index(self._rank_rows[r][job_rows]))
            if tuple(part.shape[1:]) != tuple(local):
                raise RunFileError(f"{self.holders[r].optimizer.run.path}: {kind!r} of parameter {self.name!r} "
                                   f"has shape {list(part.shape[1:])}, its shard {list(local)}")
            if parts and part.dtype != next(iter(parts.values())).dtype:  # stitching would cast one shard silently
                raise RunFileError(_dtype_conflict(self, kind, r, part.dtype, next(iter(parts.values())).dtype))
            parts[r] = part
        # A tensor with no elements: no rank holds any part of it.
        dtype = next(iter(parts.values())).dtype if parts else torch.float32
        out = self._layout.whole(parts, dtype, rows=len(job_rows))
        return out[0] if single else out

    def state_at(self, row: int) -> dict[str, torch.Tensor]:
        """Optimizer state (before the step) at one row. A sharded parameter's state tensors shaped like its shards
        are stitched like it; a scalar (Adam's ``step``) is taken from one rank; state of another shape (factored
        moments) cannot be stitched and is left out: read it per rank from ``holders``."""
        index = clip_rows(row, self.num_rows, self.name)
        if self.layout != SHARDED:
            r = self._readers[0]
            return self.holders[r].state_at(int(self._rank_rows[r][index]))
        states = {r: self.holders[r].state_at(int(self._rank_rows[r][index])) for r in self._readers}
        out = {}
        for key in self.state_keys:
            if any(key not in states[r] for r in self._readers):
                continue
            stored = {self.holders[r].state_shape(key) for r in self._readers}
            if stored == {()}:  # a scalar every rank holds whole
                out[key] = states[self._readers[0]][key]
            elif all(self.holders[r].state_shape(key) == tuple(self._layout.boxes[r][1]) for r in self._readers):
                first = states[self._readers[0]][key].dtype
                for r in self._readers:
                    if states[r][key].dtype != first:
                        raise RunFileError(_dtype_conflict(self, f"state {key!r}", r, states[r][key].dtype, first))
                out[key] = self._layout.whole({r: states[r][key] for r in self._readers}, first)
        return out

    def _has(self, kind: str) -> bool:
        return kind in self.kinds

    def __repr__(self) -> str:
        return f"<JobParam {self.name} {list(self.shape)} {self.layout} on ranks {_ranks_text(self.ranks)}, " \
               f"{self.num_rows} rows>"


class JobOptimizer:
    """One recorded optimizer of a job: the OptimizerRun API over the steps every rank file committed.

    ``rank_optimizers``: {rank: that rank's OptimizerRun}. The record table (steps, backward passes, wall times,
    lrs, hyperparameters) is the lowest rank's at the aligned records."""

    def __init__(self, job: "Job", index: int, rank_optimizers: dict):
        self.run = job
        self.index = index
        self.rank_optimizers = dict(sorted(rank_optimizers.items()))
        self.primary = self.rank_optimizers[min(self.rank_optimizers)]
        self.meta = self.primary.meta
        self.class_name = self.primary.class_name
        self.steps = common_steps([o.steps for o in self.rank_optimizers.values()])
        self.rank_records = {r: positions(o.steps, self.steps) for r, o in self.rank_optimizers.items()}
        rows = self.rank_records[min(self.rank_optimizers)]
        self.num_records = len(self.steps)
        self.backward_passes = self.primary.backward_passes[rows]
        self.wall_times = self.primary.wall_times[rows]
        self.learning_rates = self.primary.learning_rates[rows]
        self.rank_stats_steps = {r: o.committed_stats_steps() for r, o in self.rank_optimizers.items()}
        self.stats_steps = common_steps(list(self.rank_stats_steps.values()))
        # What the lowest rank's statistics rows say of those steps (backward passes, wall times, lrs): as a file's
        own = self.primary.stats_table_steps
        at = positions(own.steps, self.stats_steps)
        self.stats_table_steps = own._replace(steps=self.stats_steps, backward_passes=own.backward_passes[at],
                                              wall_times=own.wall_times[at], learning_rates=own.learning_rates[at])
        parallelism = job.parallelism
        self.param_records: dict[str, JobParam] = {}
        for name, holders in self._holders(lambda o: {n: p.meta for n, p in o.param_records.items()}).items():
            layout = self._layout(name, holders, parallelism)
            self.param_records[name] = JobParam(
                self, name, layout, {r: self.rank_optimizers[r].param_records[name] for r in holders})
        self.stats_layouts: dict[str, ParamLayout] = {
            name: self._layout(name, holders, parallelism)
            for name, holders in self._holders(lambda o: stats_param_meta(o)).items()}

    def _holders(self, metas_of) -> dict[str, dict]:
        """{name: {rank: meta}} over the ranks, names in order of first appearance (rank 0's order first)."""
        out: dict[str, dict] = {}
        for r, opt in self.rank_optimizers.items():
            with opt._reading("parameter metadata"):
                metas = metas_of(opt)
            for name, meta in metas.items():
                out.setdefault(name, {})[r] = meta
        return out

    def _layout(self, name: str, metas: dict, parallelism) -> ParamLayout:
        try:
            return param_layout(metas, parallelism)
        except ValueError as exc:
            raise RunFileError(f"{self.run.path}: parameter {name!r} of optimizer {self.index}: {exc}") from None

    def _primary_record(self, record: int) -> int:
        if not 0 <= record < self.num_records:
            raise IndexError(f"record {record} out of range ({self.num_records} records)")
        return int(self.rank_records[min(self.rank_optimizers)][record])

    def hparams(self, record: int) -> list[dict]:
        """The param groups' hyperparameters at one record (the lowest rank's; every rank steps the same groups)."""
        return self.primary.hparams(self._primary_record(record))

    def closure_losses(self, record: int) -> list | None:
        return self.primary.closure_losses(self._primary_record(record))

    def committed_stats_steps(self) -> np.ndarray:
        return self.stats_steps

    @property
    def num_param_groups(self) -> int:
        return self.primary.num_param_groups

    def stats_state_keys(self) -> list[str]:
        return self.primary.stats_state_keys()

    def step_hparams(self, step: int) -> list[dict] | None:
        """The param groups' hyperparameters at a step of the job (the lowest rank's), None for another step."""
        if step not in self.steps and step not in self.stats_steps:
            return None
        return self.primary.step_hparams(step)

    def scalars(self):
        """The logged scalars of the lowest recording rank (each rank logs its own: a loss is usually the same)."""
        return self.primary.scalars()

    def stats_param_meta(self) -> dict:
        """{name: meta} of the statistics table's parameters, shapes those of the whole tensors."""
        out = {}
        for name, layout in self.stats_layouts.items():
            first = min(layout.boxes)
            meta = {k: v for k, v in stats_param_meta(self.rank_optimizers[first]).get(name, {}).items()
                    if k != OFFSET}
            meta["shape"] = list(layout.shape)
            out[name] = meta
        return out

    def missing_steps(self) -> dict[int, np.ndarray]:
        """{rank: steps (full records or statistics) that another rank's file committed and this one lacks}."""
        every = np.union1d(np.unique(np.concatenate([o.steps for o in self.rank_optimizers.values()])),
                           np.unique(np.concatenate(list(self.rank_stats_steps.values()))))
        out = {}
        for r, opt in self.rank_optimizers.items():
            lacking = np.setdiff1d(every, np.union1d(opt.steps, self.rank_stats_steps[r]))
            if len(lacking):
                out[r] = lacking.astype(np.int64)
        return out

    def __repr__(self) -> str:
        return (f"<JobOptimizer {self.index} {self.class_name}: {len(self.param_records)} params, "
                f"{self.num_records} records on ranks {_ranks_text(self.rank_optimizers)}>")


class Job(RunReader):
    """A distributed job's rank files read as one run. ``upd.open_run(path)`` opens one when `path` itself does not
    exist but rank files for it do. The reader API of ``Run``, plus ``ranks`` ({rank: Run}), ``world_size``,
    ``parallelism`` and ``missing_ranks``."""

    def __init__(self, path, live_timeout: float | None = None):
        self.path = os.fspath(path)
        self.ranks: dict[int, Run] = {}
        try:
            self.world_size, files = rank_files(self.path)
        except ValueError as exc:
            raise RunFileError(str(exc)) from None
        if not files:
            raise RunFileError(f"{self.path}: no such run, and no rank files of a distributed job for it")
        try:
            for rank, file in files.items():
                self.ranks[rank] = Run(file, live_timeout=live_timeout)
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        recording = set()
        for rank, run in self.ranks.items():
            dist = run.meta.get(schema.META_DISTRIBUTED)
            if dist is None:
                recording.add(schema.ALL_RANKS)
                continue
            if not isinstance(dist, dict) or dist.get("rank") != rank or dist.get("world_size") != self.world_size:
                raise RunFileError(f"{run.path}: named as rank {rank} of {self.world_size}, but its metadata says "
                                   f"{_dist_text(dist)}")
            value = dist.get("recording_ranks")
            if not (value == schema.ALL_RANKS or (isinstance(value, list) and value and all(
                    isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.world_size for r in value))):
                raise RunFileError(f"{run.path}: its metadata's recording_ranks {str(value)[:40]} is neither "
                                   f"{schema.ALL_RANKS!r} nor a list of ranks below {self.world_size}")
            recording.add(schema.ALL_RANKS if value == schema.ALL_RANKS else tuple(value))
        if len(recording) > 1:
            raise RunFileError(f"{self.path}: its rank files disagree on which ranks record "
                               f"({', '.join(sorted(map(str, recording)))}): they are not of one job")
        chosen = recording.pop()
        expected = range(self.world_size) if chosen == schema.ALL_RANKS else chosen
        for rank in expected:
            if rank not in self.ranks:
                raise RunFileError(f"{self.path}: rank {rank} of {self.world_size} is missing: "
                                   f"{rank_path(self.path, rank, self.world_size)}")
        self.recording_ranks = schema.ALL_RANKS if chosen == schema.ALL_RANKS else list(chosen)
        self.primary = self.ranks[min(self.ranks)]
        versions = {run.format_version for run in self.ranks.values()}
        if len(versions) > 1:
            raise RunFileError(f"{self.path}: its rank files have different format versions "
                               f"({', '.join(map(str, sorted(versions)))})")
        self.format_version = self.primary.format_version
        self.meta = self.primary.meta
        dist = self.meta.get(schema.META_DISTRIBUTED)
        self.parallelism = dist.get("parallelism") if isinstance(dist, dict) else None
        indices = {rank: [opt.index for opt in run.optimizers] for rank, run in self.ranks.items()}
        first = indices[min(indices)]
        for rank, found in indices.items():
            if found != first:
                raise RunFileError(f"{self.ranks[rank].path}: rank {rank} recorded optimizers {found}, rank "
                                   f"{min(indices)} {first}: the files are not of one job")
        self.optimizers = []
        for position, index in enumerate(first):
            per_rank = {rank: run.optimizers[position] for rank, run in self.ranks.items()}
            classes = {opt.class_name for opt in per_rank.values()}
            if len(classes) > 1:
                raise RunFileError(f"{self.path}: optimizer {index} is of different classes on different ranks "
                                   f"({', '.join(sorted(classes))})")
            self.optimizers.append(JobOptimizer(self, index, per_rank))
        # Model parameters no rank's optimizer holds (a ZeRO rank's local optimizer holds its partition only).
        not_optimized = [set(run.params_not_optimized) for run in self.ranks.values()]
        self.params_not_optimized = [n for n in self.primary.params_not_optimized
                                     if all(n in names for names in not_optimized)]

    # -- overview ---------------------------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        """True when a writer had any rank file open: each is read from a copy taken between two records."""
        return any(run.live for run in self.ranks.values())

    @property
    def size_bytes(self) -> int:
        return sum(run.size_bytes for run in self.ranks.values())

    @property
    def missing_ranks(self) -> dict[int, list[int]]:
        """The ranks whose files lack steps: {rank: the steps another rank's file committed and this rank's did
        not} (all optimizers, full records and statistics); empty when every file holds every step. The job reads
        only the steps every file holds. (A missing rank *file* is an error when the job is opened.)"""
        out: dict[int, set] = {}
        for opt in self.optimizers:
            for rank, steps in opt.missing_steps().items():
                out.setdefault(rank, set()).update(int(s) for s in steps)
        return {rank: sorted(steps) for rank, steps in sorted(out.items())}

    # -- tables -----------------------------------------------------------------------------------------------
    def params(self) -> pd.DataFrame:
        """One row per logical parameter, as Run.params() (shape the whole tensor's), with its layout and ranks."""
        rows = []
        for opt in self.optimizers:
            for entry in param_entries(opt, opt.stats_param_meta()):
                where = opt.param_records.get(entry["name"]) or opt.stats_layouts[entry["name"]]
                rows.append(params_row(opt, entry) | {"layout": where.layout, "ranks": list(where.ranks)})
        return pd.DataFrame(rows, columns=PARAMS_COLUMNS + ["layout", "ranks"])

    def steps(self) -> pd.DataFrame:
        """One row per step of the job with a record or a statistics row every rank file committed (and per step
        that logged scalars), as Run.steps()."""
        return steps_table(self.optimizers)

    def dumps(self) -> pd.DataFrame:
        """Every rank's flight-recorder dumps, with the rank that wrote each."""
        frames = [run.dumps().assign(rank=rank) for rank, run in self.ranks.items()]
        table = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) else \
            pd.DataFrame(columns=DUMP_COLUMNS + ["rank"])
        return table[["rank"] + DUMP_COLUMNS]

    def events(self) -> pd.DataFrame:
        """Every rank's live alerts (Run.events()), with the rank that raised each: the process that feeds the
        sinks checks them (in a job whose ranks hold parts of the parameters, rank 0, on the whole values)."""
        frames = [run.events().assign(rank=rank) for rank, run in self.ranks.items()]
        table = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) else \
            pd.DataFrame(columns=EVENT_COLUMNS + ["rank"])
        return table[["rank"] + EVENT_COLUMNS]

    def stats(self) -> pd.DataFrame:
        """The per-step statistics table of the whole job: one row per (optimizer, param, step) at the steps every
        rank committed; a sharded parameter's statistics are those of the whole tensor, combined exactly from its
        shards' (runfile.shard_stats), the others as the rank they are read from recorded them. The ranks' tables
        are read one after another: memory is that of one rank's table and the result."""
        combiners: dict[tuple, ShardCombiner] = {}
        added: dict[tuple, set] = {}
        whole: dict[tuple, pd.DataFrame] = {}
        for rank, run in self.ranks.items():
            table = run.stats()
            for opt in self.optimizers:
                own = table[(table["optimizer"] == opt.index) & table["step"].isin(opt.stats_steps)]
                for name, rows in own.groupby("param", sort=False):
                    layout = opt.stats_layouts.get(name)
                    if layout is None or rank not in layout.readers:
                        continue
                    rows = rows.drop(columns=["optimizer", "param"])
                    key = (opt.index, name)
                    if layout.layout == SHARDED:
                        combiners.setdefault(key, ShardCombiner(opt.stats_steps)).add(layout.count(rank), rows)
                        added.setdefault(key, set()).add(rank)
                    else:
                        whole[key] = rows.reset_index(drop=True)
            del table
        frames = []
        for opt in self.optimizers:
            for name, layout in opt.stats_layouts.items():
                key = (opt.index, name)
                if key in whole:
                    frame = whole[key]
                elif key in combiners and added[key] == set(layout.readers):  # else a part is absent at every step
                    frame = combiners[key].frame()
                else:
                    continue
                if len(frame):
                    frames.append(frame.assign(optimizer=opt.index, param=name))
        if not frames:
            return pd.DataFrame(columns=["optimizer", "param", "step", "lr"])
        out = pd.concat(frames, ignore_index=True)
        out = out[["optimizer", "param"] + [c for c in out.columns if c not in ("optimizer", "param")]]
        return in_model_order(out, {opt.index: opt.stats_param_meta() for opt in self.optimizers})

    def ratios(self, block_bytes: int = DEFAULT_BLOCK_BYTES, source: str = "auto") -> pd.DataFrame:
        """As Run.ratios(), for the whole tensors: from stitched full records, or from the shards' statistics
        combined exactly."""
        stats_rows = {opt.index: len(opt.stats_steps) for opt in self.optimizers}
        return ratios_table(self, block_bytes, source, stats_rows, self.stats)

    def describe(self) -> dict:
        """What the job holds (what `upd info` prints): Run.describe()'s keys for the whole job, each parameter
        with its layout and ranks, and under "job" the world size and what each rank's file holds."""
        optimizers = []
        for opt in self.optimizers:
            stats_meta = opt.stats_param_meta()
            entry = describe_optimizer(opt, len(opt.stats_steps), stats_meta)
            for p in entry["params"]:
                where = opt.param_records.get(p["name"]) or opt.stats_layouts[p["name"]]
                p["layout"], p["ranks"] = (where.layout, list(where.ranks))
            optimizers.append(entry)
        missing = self.missing_ranks
        ranks = []
        for rank, run in self.ranks.items():
            ranks.append({"rank": rank, "path": run.path, "size_bytes": run.size_bytes, "live": run.live,
                          "optimizers": [{"index": o.index, "records": o.num_records,
                                          "stats_steps": int(len(o.committed_stats_steps())),
                                          "first_step": int(o.steps[0]) if len(o.steps) else None,
                                          "last_step": int(o.steps[-1]) if len(o.steps) else None}
                                         for o in run.optimizers],
                          "lacks_steps": step_ranges(missing.get(rank, []))})
        return {"path": self.path, "live": self.live, "size_bytes": self.size_bytes,
                "format_version": self.format_version, "torch_version": self.torch_version,
                "upd_version": self.meta.get("upd_version"), "created_unix": self.meta.get("created_unix"),
                "options": self.options, "params_not_optimized": self.params_not_optimized, "optimizers": optimizers,
                "job": {"world_size": self.world_size, "parallelism": self.parallelism,
                        "recording_ranks": self.recording_ranks, "ranks": ranks}}

    def close(self) -> None:
        for run in self.ranks.values():
            run.close()

    def __repr__(self) -> str:
        return (f"<upd.Job {self.path!r}: {len(self.ranks)} rank files of {self.world_size}, "
                + ", ".join(repr(o) for o in getattr(self, "optimizers", [])) + ">")


def _dist_text(dist) -> str:
    if isinstance(dist, dict):
        return f"rank {dist.get('rank')} of {dist.get('world_size')}"
    return f"{str(dist)[:60]!r}"
