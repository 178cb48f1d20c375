"""The recorder: attaches to optimizers through torch's step pre/post hooks and writes what each step did.

This module holds the hooks and the recorder's lifecycle; the pieces it drives live next to it: parameter names
(``naming``), copies of tensors (``snapshots``), statistics on the device (``device_stats``), the flight recorder
(``flight_recorder``) and resume checks (``resume``). What reaches the writer is a ``upd.runfile.record.Record``.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
import warnings
from typing import Sequence

import torch

from .. import __version__, lifetime
from ..integrations.tensorboard import TensorBoardSink
from ..runfile import encoding, schema
from ..runfile.async_writer import AsyncRunWriter
from ..runfile.record import ParamSnapshot, Record, ShardLayout, param_meta
from . import distributed, job_scalars
from .device_stats import StepStatistics, element_count
from .flight_recorder import FlightRecorder
from .job_scalars import JobScalars, Slot
from .naming import ParamNames, is_selected, model_names, named_parameters, patterns, uncompiled
from .resume import has_step_counter, initial_step, resume_problems
from .snapshots import (cpu_copy, dense, dtensor_class, hparams_snapshot, local_part, refuse_unlike_param,
                        shard_layout, state_snapshot)


def eager(hook):
    """`hook` excluded from torch.compile: a compiled ``optimizer.step`` (or model) calls the recorder's hooks, and
    dynamo must not trace them (tracing the copies and counts is slower than running them, 5.5x on a compiled step,
    and recompiles for every parameter shape). The recorder's work runs as it does in eager mode."""
    return torch.compiler.disable(hook, reason="torch-upd's recorder runs eagerly")


class RecorderWarning(UserWarning):
    """The recorder stopped recording; training goes on."""


@dataclasses.dataclass
class _TrackedParam:
    """One selected parameter during a step."""

    live: torch.Tensor  # the parameter itself
    snapshot: ParamSnapshot  # its name and place; at a full step also the CPU copies the record stores
    before: torch.Tensor | None = None  # statistics-only step: its value before the step, kept on its device


@dataclasses.dataclass
class _StepInProgress:
    """What the recorder holds between the pre- and the post-step hook; only `record` goes to the writer."""

    record: Record
    params: list[_TrackedParam]
    selected: bool  # chosen by every= (with a flight recorder, full snapshots are kept for other steps too)
    closure: bool  # step(closure): the gradient exists only inside the step
    stats: StepStatistics | None  # a statistics step: some launched before the step, the rest after it


class Recorder:
    """Records param groups, parameters before/after, gradients and optimizer state at each optimizer step.

    Use ``upd.record(...)`` to make one. See its docstring for the options.
    """

    def __init__(self, path, model=None, optimizer=None, *, every: int | None = 1, stats_every: int | None = None,
                 include=None, exclude=None, what: Sequence[str] = schema.WHAT_CHOICES, dtype: str = "keep",
                 compression=None, tensorboard=None, zero_counts: Sequence[str] = ("grad",),
                 flight_recorder: int | None = None,
                 spike_factor: float = 10.0, overwrite: bool = False, resume: bool = False, strict: bool = False,
                 ranks=None):
        for label, cadence in (("every", every), ("stats_every", stats_every)):
            if cadence is not None and (not isinstance(cadence, int) or isinstance(cadence, bool) or cadence < 1):
                raise ValueError(f"{label} must be a positive integer or None, got {cadence!r}")
        if tensorboard is not None and stats_every is None:
            stats_every = 1  # TensorBoard scalars come from the statistics: log them at every step
        if flight_recorder is not None and (not isinstance(flight_recorder, int) or flight_recorder < 1):
            raise ValueError(f"flight_recorder must be a positive number of steps or None, got {flight_recorder!r}")
        if not spike_factor > 1:
            raise ValueError(f"spike_factor must be > 1, got {spike_factor!r}")
        if every is None and stats_every is None and flight_recorder is None:
            raise ValueError("every=None and stats_every=None would record nothing")
        what = (what,) if isinstance(what, str) else tuple(what)
        unknown = set(what) - set(schema.WHAT_CHOICES)
        if unknown:
            raise ValueError(f"what= accepts {schema.WHAT_CHOICES}, got {sorted(unknown)}")
        if dtype not in schema.STORAGE_DTYPES:
            raise ValueError(f"dtype= must be one of {schema.STORAGE_DTYPES}, got {dtype!r}")
        if compression not in (None, "gzip", "lzf"):
            raise ValueError(f"compression= must be None, 'gzip' or 'lzf', got {compression!r}")
        zero_counts = (zero_counts,) if isinstance(zero_counts, str) else tuple(zero_counts)
        if set(zero_counts) - {"param", "grad", "update", "state"}:
            raise ValueError(f"zero_counts= takes 'param', 'grad', 'update', 'state'; got {zero_counts!r}")
        if overwrite and resume:
            raise ValueError("pass overwrite=True or resume=True, not both")

        # An inactive recorder from here on: everything below that cannot record returns it as it is (one
        # RecorderWarning, no hooks, no file), so that setup never breaks the training either.
        self.path = os.fspath(path)
        self.rank_setup = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.every = every
        self.stats_every = stats_every
        self.flight_recorder = flight_recorder
        self.strict = strict
        self.active = False
        self.error: BaseException | None = None
        self._flight: FlightRecorder | None = None  # made with the writer it dumps to
        self._tensorboard = None  # the sink this rank writes to
        self._handles = []
        self._pending: dict[int, _StepInProgress] = {}
        self._records = 0  # records written at the cadences (the flight recorder counts its dumps)
        self._job_scalars: JobScalars | None = None

        try:
            # Wrappers (Accelerate, Lightning) are looked through here; DDP and ZeRO by `distributed`, which
            # needs to see them to decide which ranks record.
            job_optimizers = attachable_optimizers(optimizer)
            model = attachable_model(model)
            # In a distributed job: which ranks record, into which file. Decided from the wrappers the user passed
            # (DDP, ZeRO), then recording looks through them: names from the wrapped model, hooks on the optimizer
            # that steps this rank's parameters.
            self.rank_setup = distributed.setup(path, model, job_optimizers, ranks)
            model = uncompiled(distributed.unwrap_model(model))
            optimizers = [distributed.local_optimizer(opt) for opt in job_optimizers]
            for opt in optimizers:
                check_hookable(opt)
        except TypeError as exc:
            self._cannot_record(exc)
            return
        recording_here = self.rank_setup is None or self.rank_setup.records
        if recording_here and self.rank_setup:
            self.path = self.rank_setup.file
        self.optimizers = optimizers
        self.zero_counts = zero_counts
        self.spike_factor = spike_factor
        self.include = patterns(include)
        self.exclude = patterns(exclude)
        self.what = what
        self._backward_counts: dict[int, int] = {}
        self._hooked_params: set[int] = set()
        self._layouts: dict[int, tuple] = {}  # parameter ids when names were last assigned
        self._shards: dict[int, ShardLayout] = {}  # id(DTensor parameter) -> its ShardLayout, found with its name
        self._job_optimizers = job_optimizers
        self._job_parts: dict[int, tuple[int, dict]] = {}  # optimizer -> (step, its parts' statistics), until shared
        self._job_slots: dict[int, tuple[tuple, list[Slot]]] = {}  # optimizer -> (parameter ids, slots)
        try:
            # Everything the run's metadata needs from the model and the optimizers, read before the file exists:
            # an object that only looks like them fails here, and leaves no file behind.
            names_in_model = model_names(model)
            self._steps_done = [initial_step(opt) for opt in optimizers]
            self._names = [ParamNames({**distributed.global_names(opt), **names_in_model})
                           for opt in job_optimizers]
            opt_metas = [self._optimizer_meta(i, opt) for i, opt in enumerate(optimizers)]
            # A ZeRO rank's local optimizer holds its partition only; the job's optimizer holds them all.
            optimized = {id(p) for opt in job_optimizers for g in opt.param_groups for p in g["params"]}
            not_optimized = None if model is None else [
                name for name, p in named_parameters(model) if id(p) not in optimized]
        except Exception as exc:
            self._cannot_record(exc)
            return

        tensorboard_role = (distributed.TB_NONE if tensorboard is None else
                            distributed.tensorboard_role(self.rank_setup))
        if tensorboard_role == distributed.TB_OWN or (tensorboard_role == distributed.TB_JOB
                                                      and self.rank_setup.rank == 0):
            self._tensorboard = TensorBoardSink(tensorboard)
        # A split job's TensorBoard scalars: every rank adds its parts' statistics, rank 0 writes (job_scalars).
        if tensorboard_role == distributed.TB_JOB:
            self._job_scalars = JobScalars(self.rank_setup.rank, self.rank_setup.world_size, stats_every,
                                           list(self._steps_done), self._slots, self._warn_job_scalars)
        if not recording_here:
            return  # another rank records: no file, no hooks, nothing to close

        meta = {
            "upd_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "created_unix": time.time(),
            "argv": list(sys.argv),
            "options": {"every": every, "stats_every": stats_every, "zero_counts": list(zero_counts),
                        "flight_recorder": flight_recorder,
                        "spike_factor": spike_factor, "include": self.include, "exclude": self.exclude, "what": list(what),
                        "dtype": dtype, "compression": compression},
            "optimizer_count": len(optimizers),
        }
        if self.rank_setup is not None:
            meta[schema.META_DISTRIBUTED] = self.rank_setup.meta()
            conflict = distributed.layout_conflict(self.rank_setup)
            if conflict:
                raise ValueError(f"{self.path}: cannot {'resume' if resume else 'record'}: {conflict}")
        # Resuming appends to the user's file: a failure below never removes it. Any other file is this
        # recorder's own, removed again if setup fails after creating it: a stub would read as an empty run.
        existed = os.path.exists(self.path)
        ours = not (resume and existed)
        # HDF5 writes happen on a writer thread behind a queue of 2 records: training waits only when the disk is
        # slower than training (+5% instead of +24% inline, docs/background.md).
        try:
            self._writer = AsyncRunWriter(self.path, meta, overwrite=overwrite, storage_dtype=dtype,
                                          compression=compression, resume=resume, max_pending=2)
        except FileExistsError:
            # Refusing to overwrite is the answer the user asked for (overwrite= defaults to False to protect an
            # earlier run): raised, before the first step, like a bad option value.
            raise
        except Exception as exc:  # permission denied, read-only or full filesystem: never stop the training
            if not existed:
                _remove_quietly(self.path)
            self._cannot_record(exc)
            if self._job_scalars is not None:  # the other ranks all-reduce with this one: keep joining, with nothing
                for i, opt in enumerate(optimizers):
                    self._handles.append(opt.register_step_post_hook(self._make_post_hook(i)))
            return
        if flight_recorder is not None:
            self._flight = FlightRecorder(self._writer, len(optimizers), flight_recorder, spike_factor)
        try:
            if resume:
                for i, opt in enumerate(optimizers):
                    self._check_resume(i, opt, opt_metas[i])
        except BaseException:
            self._discard_writer(ours)
            raise  # a run that cannot be continued: the user's mistake, like an existing file without overwrite=
        try:
            for i, opt in enumerate(optimizers):
                self._writer.add_optimizer(i, opt_metas[i])
                self._handles.append(opt.register_step_pre_hook(self._make_pre_hook(i)))
                self._handles.append(opt.register_step_post_hook(self._make_post_hook(i)))
            for opt in optimizers:
                # Count from the very first backward pass: before the first step, accumulation and skipped steps
                # would otherwise be invisible.
                for group in opt.param_groups:
                    for p in group["params"]:
                        self._hook_backward_counter(p)
            if not_optimized is not None:
                self._writer.set_attr(schema.ATTR_PARAMS_NOT_OPTIMIZED, not_optimized)
        except Exception as exc:
            self._discard_writer(ours)
            self._cannot_record(exc)
            return
        except BaseException:
            self._discard_writer(ours)
            raise
        self.active = True
        lifetime.recorders.add(self)

    def _cannot_record(self, exc: Exception) -> None:
        """Setup found something it cannot record: the recorder stays inactive, with one warning (the exception
        itself with strict=True; called inside the ``except`` that caught it)."""
        self._remove_hooks()
        self.error = exc
        if self.strict:
            raise exc
        warnings.warn(f"torch-upd: cannot record to {self.path} ({type(exc).__name__}: {exc}); training "
                      "continues without recording. Pass strict=True to raise instead.", RecorderWarning,
                      stacklevel=4)

    def _discard_writer(self, ours: bool) -> None:
        """Undo a setup that created the writer and then failed: no hooks, the file closed, and removed when it is
        this recorder's own."""
        self._remove_hooks()
        self._writer.abort()
        self._flight = None
        if ours:
            _remove_quietly(self.path)

    def _optimizer_meta(self, index: int, opt) -> dict:
        """The optimizer's entry in the run's metadata."""
        return {
            "class": encoding.class_path(type(opt)),
            "mro": [encoding.defining_path(c) for c in type(opt).__mro__ if issubclass(c, torch.optim.Optimizer)],
            "defaults": encoding.jsonable({k: v for k, v in opt.defaults.items() if k != "params"}),
            "initial_step": self._steps_done[index],
            "params": self._param_layout(index, opt),
        }

    def _param_layout(self, opt_index: int, opt) -> list:
        """Name, shape and group of every parameter the optimizer holds now (resume compares against it)."""
        names = self._names[opt_index]
        return [{"name": names.name(p, g, i, group), "shape": list(p.shape), "group": g}
                for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])]

    def _check_resume(self, index: int, opt, opt_meta: dict) -> None:
        stored = self._writer.optimizer_meta(index)
        if stored is None:
            return  # an optimizer the earlier run did not have: recorded from now on
        problems = resume_problems(index, stored, opt_meta)
        if problems:
            self._writer.close()
            raise ValueError(f"{self.path}: cannot resume into this run: " + "; ".join(problems)
                             + ". Record to a new file instead.")
        if not has_step_counter(opt):
            # No step counter in the optimizer's state (plain SGD): continue after the last recorded step.
            last = self._writer.last_step(index)
            if last is not None:
                self._steps_done[index] = max(self._steps_done[index], last + 1)

    # -- backward-pass counting -------------------------------------------------------------------------------
    def _hook_backward_counter(self, param: torch.Tensor) -> None:
        # Counting backward passes per parameter shows gradient accumulation and steps skipped by GradScaler
        # (backward passes that were followed by no optimizer step), which the optimizer's own counters cannot.
        if id(param) in self._hooked_params or not param.requires_grad or not param.is_leaf:
            return
        key = id(param)
        self._hooked_params.add(key)
        self._backward_counts[key] = 0

        def count(_param, key=key):
            self._backward_counts[key] += 1

        self._handles.append(param.register_post_accumulate_grad_hook(eager(count)))

    # -- hooks ------------------------------------------------------------------------------------------------
    def _make_pre_hook(self, opt_index: int):
        def pre_hook(optimizer, args, kwargs):
            if not self.active:
                return None
            # args is (optimizer, *step_args): a closure is step's first positional argument or `closure=`.
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
            self._guard(self._before_step, opt_index, optimizer, closure is not None)
            pending = self._pending.get(opt_index)
            if closure is None or pending is None or not self.active:
                return None
            wrapped = self._wrap_closure(pending, closure)
            if len(args) > 1:
                return (args[0], wrapped, *args[2:]), kwargs
            return args, dict(kwargs, closure=wrapped)
        return eager(pre_hook)

    def _wrap_closure(self, pending: _StepInProgress, closure):
        """Closure-driven optimizers (LBFGS) compute the gradient inside step(): capture the gradient of the first
        evaluation (at the parameters before the step) and every evaluation's loss."""
        @eager
        def record_evaluation(loss):
            if self.active:
                self._guard(self._closure_evaluated, pending, loss)

        def recording_closure(*args, **kwargs):
            loss = closure(*args, **kwargs)  # the user's closure: compiled if the step is
            record_evaluation(loss)
            return loss
        return recording_closure

    def _closure_evaluated(self, pending: _StepInProgress, loss) -> None:
        losses = pending.record.closure_losses
        first = not losses
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        losses.append(float(value) if value is not None else float("nan"))
        if first and "grad" in self.what and pending.record.full:
            for tracked in pending.params:
                if tracked.live.grad is not None:
                    tracked.snapshot.grad = cpu_copy(tracked.live.grad)

    def _make_post_hook(self, opt_index: int):
        def post_hook(optimizer, args, kwargs):
            if self.active:
                self._guard(self._after_step, opt_index, optimizer)
            if self._job_scalars is not None:  # after every step, recording or not: the ranks join in step
                self._share_job_scalars(opt_index)
        return eager(post_hook)

    def _guard(self, fn, *args) -> None:
        with lifetime.signals_deferred(self):  # no SIGTERM closes the file under a write in progress
            try:
                fn(*args)
            except Exception as exc:  # never take training down with the recorder
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.active = False
        self._pending.clear()
        if self._flight is not None:
            self._flight.clear()
        # The hooks stay registered (inactive) until close(): removing them here, while torch iterates over the
        # optimizer's hook dict, would raise "OrderedDict mutated during iteration" into the training loop.
        self._writer.abort()
        if self.strict:
            raise exc
        # The traceback holds the writer's frames and their HDF5 objects; freed after the file is gone, those
        # objects make HDF5 try to write again at exit (and crash the process on a full disk).
        exc.__traceback__ = None
        exc.__context__ = None
        warnings.warn(f"torch-upd: recording to {self.path} stopped ({type(exc).__name__}: {exc}); "
                      "training continues. Pass strict=True to raise instead.", RecorderWarning, stacklevel=4)

    # -- one step ---------------------------------------------------------------------------------------------
    def _before_step(self, opt_index: int, optimizer: torch.optim.Optimizer, closure_step: bool = False) -> None:
        self._pending.pop(opt_index, None)  # a step that raised never reached its post-hook
        step = self._steps_done[opt_index]
        names = self._names[opt_index]
        # Names and backward counters only change when parameters do (add_param_group, a swapped tensor): a tuple
        # of ids is far cheaper than naming and hooking every parameter again at every step.
        layout = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
        dtensor = dtensor_class()
        if self._layouts.get(opt_index) != layout:
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    name = names.name(p, g, i, group)
                    layout_of_part = shard_layout(p, f"parameter {name}")
                    if layout_of_part is not None:
                        self._shards[id(p)] = layout_of_part
                    self._hook_backward_counter(p)
            self._layouts[opt_index] = layout
        selected = self.every is not None and step % self.every == 0
        full = selected or self._flight is not None  # the flight recorder keeps every step in memory
        with_stats = self.stats_every is not None and step % self.stats_every == 0
        if not (full or with_stats):
            return
        params = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = names[p]
                # The optimizer skips a parameter without a gradient, so there is nothing to record for it; with a
                # closure the gradient appears only inside step(), so that is decided after the step.
                if (p.grad is None and not closure_step) or not is_selected(name, self.include, self.exclude):
                    continue
                if dtensor is not None:  # DTensor gradients and state are stored as the parameter's part
                    refuse_unlike_param(p.grad, p, f"the gradient of {name}")
                    for key, value in optimizer.state.get(p, {}).items():
                        refuse_unlike_param(value, p, f"optimizer state {key!r} of {name}")
                tracked = _TrackedParam(live=p, snapshot=ParamSnapshot(name=name, group=g, index_in_group=i,
                                                                       shard=self._shards.get(id(p))))
                if full:
                    snap = tracked.snapshot
                    if "param" in self.what:
                        snap.param = cpu_copy(p)
                    if "grad" in self.what and not closure_step:
                        snap.grad = cpu_copy(p.grad)
                    if "state" in self.what:
                        snap.state = state_snapshot(optimizer.state.get(p, {}))
                else:
                    # Statistics only: the one snapshot the update needs, kept on the parameter's device and freed
                    # after the step.
                    tracked.before = local_part(p.detach()).clone()
                params.append(tracked)
        backward = max((self._backward_counts.get(id(p), 0) for g in optimizer.param_groups for p in g["params"]),
                       default=0)
        stats = None
        if with_stats:
            stats = StepStatistics(self.zero_counts)
            if not full:
                self._launch_stats_before_step(stats, params, optimizer, closure_step)
        record = Record(optimizer=opt_index, step=step, backward_pass=backward, wall_time=time.time(),
                        hparams=[hparams_snapshot(g) for g in optimizer.param_groups],
                        params=[t.snapshot for t in params] if full else [],
                        closure_losses=[] if closure_step else None, full=full)
        self._pending[opt_index] = _StepInProgress(record=record, params=params, selected=selected,
                                                   closure=closure_step, stats=stats)

    @staticmethod
    def _launch_stats_before_step(stats: StepStatistics, params: list[_TrackedParam], optimizer,
                                  closure_step: bool) -> None:
        """Gradient and state statistics of a statistics-only step must see the values before the step (the state is
        updated in place): launched now for all parameters at once, read after the step with everything else."""
        keys, tensors = [], []
        for tracked in params:
            p, name = tracked.live, tracked.snapshot.name
            if p.grad is not None and not closure_step:
                keys.append((name, "grad"))
                tensors.append(local_part(p.grad))
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.numel() > 0:
                    keys.append((name, f"state.{key}"))
                    tensors.append(local_part(value))
        live = {tracked.snapshot.name: tracked.live for tracked in params}

        def after_the_step():
            # A NaN/Inf recount reads the tensor again: the gradient is still there; the state has been updated
            # in place by the step, so its count is of the state after the step.
            return [local_part(live[name].grad if kind == "grad" else
                               optimizer.state.get(live[name], {}).get(kind[len("state."):])) for name, kind in keys]
        stats.launch(keys, tensors, recount=after_the_step)

    def _step_statistics(self, pending: _StepInProgress) -> dict:
        """Summary statistics of every recorded parameter at this step, with one device-to-host copy in all."""
        full = pending.record.full
        keys, tensors, update_keys, updates = [], [], [], []
        for tracked in pending.params:
            snap, live = tracked.snapshot, tracked.live  # live: the parameter itself, after the step
            if full:  # statistics of the CPU copies taken for the full record
                before = snap.param
                kinds = {"param": snap.param, "grad": snap.grad, **{f"state.{k}": v for k, v in snap.state.items()}}
            else:
                before = tracked.before
                kinds = {"param": before}
                if pending.closure and live.grad is not None:  # step(closure): the gradient of the last call
                    kinds["grad"] = local_part(live.grad)
            for kind, t in kinds.items():
                if t is not None:
                    keys.append((snap.name, kind))
                    tensors.append(t)
            if before is not None:
                after = local_part(live.detach())
                updates.append((dense(after).to("cpu") if full else after) - before)
                update_keys.append((snap.name, "update"))
        pending.stats.launch(keys, tensors)
        pending.stats.launch(update_keys, updates)
        return pending.stats.read()

    def _after_step(self, opt_index: int, optimizer: torch.optim.Optimizer) -> None:
        self._steps_done[opt_index] += 1
        pending = self._pending.pop(opt_index, None)
        if pending is None:
            return
        rec = pending.record
        if pending.closure and "grad" in self.what and rec.full:
            # Parameters the closure gave no gradient were skipped by the optimizer, as in a plain step.
            pending.params = [t for t in pending.params if t.snapshot.grad is not None]
            rec.params = [t.snapshot for t in pending.params]
        if pending.stats is not None:
            rec.stats = self._step_statistics(pending)
            rec.stats_meta = {t.snapshot.name: param_meta(t.snapshot, local_part(t.live)) for t in pending.params}
            if self._job_scalars is not None:
                self._job_parts[opt_index] = (rec.step, {
                    t.snapshot.name: (element_count(local_part(t.live)), rec.stats[t.snapshot.name])
                    for t in pending.params
                    if t.snapshot.name in rec.stats and distributed.counts_toward_whole(t.live, self.rank_setup)})
        if rec.full:
            for t in pending.params:
                t.snapshot.param_after = cpu_copy(t.live) if "param" in self.what else None
        selected = pending.selected
        del pending  # statistics only: the device snapshots are released now, before the writer may block
        if self._flight is None:
            self._writer.write(rec)
        else:
            self._flight.step(rec, selected)
        if self._tensorboard is not None and rec.stats and self._job_scalars is None:
            self._tensorboard.write(rec.step, {_tensorboard_name(opt_index, name): values
                                               for name, values in rec.stats.items()})
        if self._flight is None or selected:
            self._records += 1

    # -- a split job's TensorBoard scalars ---------------------------------------------------------------------
    def _slots(self, opt_index: int) -> list[Slot]:
        """Every selected parameter of the job's optimizer, in its order: the same on every rank (a ZeRO rank's
        local optimizer holds its partition only; the job's holds them all, in the order the user built it)."""
        optimizer = self._job_optimizers[opt_index]
        layout = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
        cached = self._job_slots.get(opt_index)
        if cached is None or cached[0] != layout:
            names = self._names[opt_index]
            recorded = [names.name(p, g, i, group) for g, group in enumerate(optimizer.param_groups)
                        for i, p in enumerate(group["params"])]
            cached = (layout, [Slot(_tensorboard_name(opt_index, name), name) for name in recorded
                               if is_selected(name, self.include, self.exclude)])
            self._job_slots[opt_index] = cached
        return cached[1]

    def _share_job_scalars(self, opt_index: int) -> None:
        """Join the statistics step's all-reduce (outside ``_guard``: a SIGTERM must still end a process waiting in
        it); rank 0 writes the result. JobScalars raises nothing; writing is a recorder error like any other."""
        parts = self._job_parts.pop(opt_index, None)
        combined = self._job_scalars.after_step(opt_index, parts if self.active else None)
        if combined is not None and self._tensorboard is not None and self.active:
            self._guard(self._write_job_scalars, *combined)

    def _write_job_scalars(self, step: int, slots: list[Slot], summed) -> None:
        self._tensorboard.write(step, job_scalars.scalars(slots, summed))

    def _warn_job_scalars(self, why: str) -> None:
        warnings.warn(f"torch-upd: the job's live TensorBoard scalars stop: {why}; training continues.",
                      RecorderWarning, stacklevel=2)

    def dump(self, reason: str = "requested by the user") -> None:
        """Write the flight recorder's in-memory steps to the run now (e.g. from your own anomaly check)."""
        if self.flight_recorder is None:
            raise RuntimeError("dump() needs upd.record(..., flight_recorder=K)")
        if not self.active:
            return
        self._guard(self._flight.dump, reason)

    # -- lifetime ---------------------------------------------------------------------------------------------
    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def records(self) -> int:
        """Records committed so far, over all optimizers."""
        return self._records + (self._flight.records_dumped if self._flight is not None else 0)

    @property
    def dumps(self) -> list[dict]:
        """The flight recorder's dumps so far: optimizer, reason, trigger_step, steps written, wall_time."""
        return self._flight.dumps if self._flight is not None else []

    def close(self) -> None:
        """Remove every hook and close the file. Safe to call twice, and after recording stopped on an error."""
        was_active = self.active
        self.active = False
        self._remove_hooks()
        self._pending.clear()
        if self._tensorboard is not None:
            self._tensorboard.close()
        lifetime.recorders.discard(self)
        if was_active:
            try:
                try:
                    self._writer.set_attr(schema.ATTR_CLOSED_CLEANLY, True)
                finally:
                    self._writer.close()
            except Exception as exc:
                # With the writer thread, a write error can surface only here: it is this run's error all the same.
                self.error = exc
                if self.strict:
                    raise
                warnings.warn(f"torch-upd: recording to {self.path} stopped ({type(exc).__name__}: {exc}); "
                              "what was committed before stays readable.", RecorderWarning, stacklevel=2)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "recording" if self.active else "closed"
        if self.rank_setup is not None and not self.rank_setup.records:
            state = f"not recording on rank {self.rank_setup.rank}"
        return f"<upd.Recorder {self.path!r} {state}, {self.records} records>"


def _tensorboard_name(opt_index: int, name: str) -> str:
    """A parameter's name in TensorBoard tags: prefixed for optimizer 1 and up, as ``export_ratios`` names them."""
    return f"opt{opt_index}:{name}" if opt_index else name


# Where optimizer wrappers keep the torch.optim.Optimizer they wrap: Accelerate's AcceleratedOptimizer and
# Lightning's LightningOptimizer (`optimizer`), others (`optim`, `_optimizer`).
WRAPPED_OPTIMIZER_ATTRIBUTES = ("optimizer", "optim", "_optimizer")


def wrapped_optimizer(obj, _seen: set | None = None):
    """The optimizer inside `obj`, looked up through WRAPPED_OPTIMIZER_ATTRIBUTES (wrappers of wrappers too) until
    a torch.optim.Optimizer that wraps no other: the one whose ``step()`` does the math, and whose step hooks fire
    (AcceleratedOptimizer subclasses torch.optim.Optimizer without initialising it, so it has no hooks of its own).
    A ZeroRedundancyOptimizer is kept as it is: ``distributed`` needs it whole. `obj` itself when it wraps none."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or isinstance(obj, distributed.zero_class() or ()):
        return obj
    seen.add(id(obj))
    for name in WRAPPED_OPTIMIZER_ATTRIBUTES:
        value = _attribute(obj, name)
        if value is not None:
            inner = wrapped_optimizer(value, seen)
            if isinstance(inner, torch.optim.Optimizer):
                return inner
    return obj


def _attribute(obj, name: str):
    try:
        return getattr(obj, name, None)
    except Exception:  # a property of someone else's wrapper: whatever it raises, it wraps nothing
        return None


def attachable_optimizers(optimizer) -> list:
    """``optimizer=`` as the list of optimizers to attach to, each looked up through its wrappers; TypeError for
    anything that is not, or does not wrap, a torch.optim.Optimizer."""
    if optimizer is None:
        raise TypeError("upd.record needs the optimizer (or a list of optimizers) to watch")
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    found = [wrapped_optimizer(opt) for opt in given]
    for opt in found:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, or a wrapper that exposes one as "
                            f"{', '.join('.' + a for a in WRAPPED_OPTIMIZER_ATTRIBUTES)}; got {type(opt).__name__}")
    return found


def check_hookable(optimizer: torch.optim.Optimizer) -> None:
    """TypeError when torch cannot call step hooks on `optimizer`: a subclass whose ``__init__`` never ran
    ``torch.optim.Optimizer.__init__`` (a wrapper that hides what it wraps)."""
    if not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        raise TypeError(f"{type(optimizer).__name__} has no optimizer step hooks (torch.optim.Optimizer.__init__ "
                        "never ran for it); pass the optimizer it wraps")


def attachable_model(model):
    """``model=`` without torch.compile's wrapper; TypeError for anything without ``named_parameters()``."""
    if model is not None and not callable(_attribute(model, "named_parameters")):
        raise TypeError(f"model= must be a torch.nn.Module (names come from its named_parameters()), got "
                        f"{type(model).__name__}")
    return uncompiled(model)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # nothing there, or not ours to remove after all: either way not the training's concern


def record(path, model=None, optimizer=None, **options) -> Recorder:
    """Record what ``optimizer.step()`` does, to one HDF5 file, without changing the training loop.

    ::

        with upd.record("runs/exp1.h5", model, optimizer):
            train()

    Args:
        path: the run file to create. An existing file is refused unless ``overwrite=True``. In a distributed job
            (an initialised ``torch.distributed`` process group of several processes; make the same call on every
            rank) `path` names the job: each recording rank writes its own file, ``runs/exp1.rank0-of-4.h5`` and so
            on, or `path` itself when rank 0 alone records. ``upd.open_run(path)`` reads the whole job.
        model: optional ``nn.Module``; parameter names come from ``model.named_parameters()`` (through a
            ``DistributedDataParallel`` wrapper: no ``module.`` prefix; through ``torch.compile``: no ``_orig_mod.``).
            Without it names come from the optimizer's ``param_names`` (when built from ``named_parameters()``),
            else ``group{g}.param{i}``.
        optimizer: a ``torch.optim.Optimizer`` or a list of them. A wrapper that exposes the optimizer it wraps as
            ``.optimizer``, ``.optim`` or ``._optimizer`` (Accelerate's ``AcceleratedOptimizer``, Lightning's
            ``LightningOptimizer``) is recorded through: the optimizer inside. A ``ZeroRedundancyOptimizer`` is
            recorded through its local optimizer: each rank records the partition it steps. What cannot be recorded
            (not an optimizer, a model that is not a module, a file that cannot be created) warns once
            (``upd.RecorderWarning``) and gives an inactive recorder, with no file; a bad option value, an
            existing file without ``overwrite=True`` and a run ``resume=True`` cannot continue are raised.
        every: record every N-th optimizer step (default 1: every step).
        tensorboard: a ``torch.utils.tensorboard.SummaryWriter`` or a log dir: ``update_to_data/<param>``,
            ``grad_to_data/<param>`` and the update, gradient and parameter norms, live, at each statistics step
            (``stats_every`` defaults to 1 then). In a distributed job rank 0 alone writes, the whole parameters'
            values. Where each rank holds a part of the model (FSDP2, ZeroRedundancyOptimizer), every rank joins one
            all-reduce of a small float64 tensor per statistics step (15 numbers per parameter and one per rank),
            in the optimizer's post-step hook; replicated training (DDP) needs none. Every rank must then make the
            same call, ``tensorboard=`` included (only rank 0 makes a writer), with the same ``stats_every``, and
            close its recorder at the same point. A recorder error on one rank stops the scalars on every rank at
            the next statistics step, never the training. Refused for a sharded job recorded on one rank only
            (``ranks=`` an int): its shards' ratios are not the parameters'.
        include / exclude: glob pattern(s) on parameter names, e.g. ``include="*.weight"``.
        what: subset of ``("param", "grad", "state")`` to store (default all three).
        dtype: storage dtype: ``"keep"`` (default, exact), ``"float32"``, ``"float16"`` or ``"bfloat16"``.
            Smaller storage limits what ``upd verify`` can prove; its report says by how much.
        compression: ``None`` (default: float32 weights barely compress and it costs 2.5-35x write time),
            ``"lzf"`` or ``"gzip"``.
        overwrite: replace an existing file.
        resume: append to an existing run (training restarted from a checkpoint): step numbers continue from the
            optimizer's own step counter (or after the last recorded step for optimizers without one); a different
            optimizer class, parameter set or shape is an error. Without an existing file, starts a new run.
        zero_counts: whose fraction of exact zeros the statistics count: any of "param", "grad", "update",
            "state" (default: gradients only; counting is the slowest statistic on CPU, 4x a sum).
        flight_recorder: keep the last K steps' full tensors in memory (no disk I/O while nothing happens) and
            write them to the run when a trigger fires: a NaN/Inf in a gradient or update, a gradient- or
            update-norm spike above ``spike_factor`` (default 10) times its recent median, or ``rec.dump(reason)``.
            The reasons are stored (``Run.dumps``); the dumped steps replay and verify like any others.
        strict: raise recorder errors (at setup too) instead of warning once and stopping recording.
        ranks: which ranks of a distributed job record (ignored in a single process). ``None`` (default): every
            rank when each holds a part of the model (FSDP2 shards, ZeroRedundancyOptimizer partitions), rank 0
            alone otherwise (DDP and other replicated training: the replicas are identical), into `path` itself.
            ``"all"``: every rank, one file each (``upd verify`` then also checks that the replicas agree). An
            int: that rank only. Other ranks get an inactive recorder (``rec.active`` is False): no file, no hooks.
            With ``resume=True`` each rank resumes its own file; the job must have the same number of processes.
    """
    return Recorder(path, model, optimizer, **options)
