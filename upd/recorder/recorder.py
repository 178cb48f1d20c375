"""The recorder: attaches to optimizers through torch's step pre/post hooks and writes what each step did.

This module holds the hooks and the recorder's lifecycle; the pieces it drives live next to it: parameter names
(``naming``), copies of tensors (``snapshots``), statistics on the device (``device_stats``), the flight recorder
(``flight_recorder``) and resume checks (``resume``). What reaches the writer is a ``upd.runfile.record.Record``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import platform
import sys
import time
import warnings

import torch

from .. import __version__, lifetime
from ..runfile import encoding, schema
from ..runfile.async_writer import AsyncRunWriter
from ..runfile.record import ParamSnapshot, Record, ShardLayout, param_meta
from ..sinks.base import SinkStep
from ..sinks.feed import SINKS_JOB, SINKS_OWN, SinkFeed, close_unused, sink_problem
from ..sinks.tensorboard import TensorBoard
from . import distributed, job_scalars
from .attaching import attach
from .device_stats import LeanStep, SnapshotPool, StepStatistics, element_count, lean_applies
from .engines import LEAN, SAMPLED, StatisticsEngine, statistics_set
from .alerts import LiveAlerts
from .flight_recorder import FlightRecorder
from .grad_norms import TotalNorm, queue_after_backward, total_norm
from .logged_scalars import HOST_BATCH_STEPS, kept, name_problem, scalar_problem, to_host
from .job_scalars import JobScalars, Slot
from .options import RecordOptions, record_signature
from .naming import ParamNames, is_selected, model_names, named_parameters, patterns
from .resume import has_step_counter, initial_step, resume_problems, truncation_text
from .sampled_stats import SampledPool, SampledStep
from .snapshots import (cpu_copy, dtensor_class, hparams_snapshot, local_part, refuse_unlike_param,
                        shard_layout, state_snapshot, wait_for_copies)


def eager(hook):
    """`hook` excluded from torch.compile: a compiled ``optimizer.step`` (or model) calls the recorder's hooks, and
    dynamo must not trace them (tracing the copies and counts is slower than running them, 5.5x on a compiled step,
    and recompiles for every parameter shape). The recorder's work runs as it does in eager mode."""
    return torch.compiler.disable(hook, reason="torch-upd's recorder runs eagerly")


class RecorderWarning(UserWarning):
    """The recorder stopped recording; training goes on."""


class TrainingAlert(RecorderWarning):
    """A live alert (``upd.record(..., alerts=True)``): a weight left the band, an update norm spiked, NaN/Inf."""


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
    stats: StatisticsEngine | None  # a statistics step: some launched before the step, the rest after it
    stats_meta: dict | None = None  # the statistics' parameter metadata, when known before the step (_LeanPlan)


@dataclasses.dataclass
class _LeanPlan:
    """What a lean statistics step needs that changes only with the optimizer's parameters: made once per parameter
    layout, so that such a step walks no parameter in Python (naming, selecting, metadata) to start."""

    layout: tuple  # the Recorder._layouts entry it was made for (compared by identity)
    tracked: list[_TrackedParam]  # the selected parameters, in the optimizer's order (never modified by a step)
    live: list[torch.Tensor]
    names: list[str]
    all_selected: bool  # every parameter of the optimizer is selected: the lean gradient norms are all of them
    stats_meta: dict  # name -> param_meta


class Recorder:
    """Records param groups, parameters before/after, gradients and optimizer state at each optimizer step.

    Use ``upd.record(...)`` to make one. See its docstring for the options.
    """

    def __init__(self, path, model=None, optimizer=None, **options):
        opts = RecordOptions.of_call(options)  # TypeError for an option that does not exist, ValueError for a bad value
        for sink in opts.sinks:
            problem = sink_problem(sink)
            if problem:
                raise TypeError(f"sinks= takes objects with write(steps) and close() (upd.sinks.Sink): {problem}")
        every, stats_every, full_stats_every, stats_sample = (opts.every, opts.stats_every, opts.full_stats_every,
                                                              opts.stats_sample)
        flight_recorder, spike_factor, strict, ranks = opts.flight_recorder, opts.spike_factor, opts.strict, opts.ranks
        what, zero_counts, dtype, compression = opts.what, opts.zero_counts, opts.dtype, opts.compression
        overwrite, resume, tensorboard, sinks = opts.overwrite, opts.resume, opts.tensorboard, list(opts.sinks)
        if opts.live() and stats_every is None:
            stats_every = 1  # live values come from the statistics: at every step

        # An inactive recorder from here on: everything below that cannot record returns it as it is (one
        # RecorderWarning, no hooks, no file), so that setup never breaks the training either.
        self.path = os.fspath(path)
        self.rank_setup = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.every = every
        self.stats_every = stats_every
        self.full_stats_every = full_stats_every
        self.stats_sample = stats_sample
        self.flight_recorder = flight_recorder
        self.strict = strict
        self.active = False
        self.error: BaseException | None = None
        self._flight: FlightRecorder | None = None  # made with the writer it dumps to
        self._sinks: SinkFeed | None = None  # the sinks this process feeds (sink_role)
        self._alerts = LiveAlerts(opts.alerts, dump=flight_recorder is not None) if opts.alerts else None
        self._given_sinks = sinks  # closed with the recorder, fed or not
        self._live_rows: dict[int, list] = {}  # a split job's rank 0: scalar rows on the host, for the sinks
        self._handles = []
        self._pending: dict[int, _StepInProgress] = {}
        self._stats_pools: dict[int, SnapshotPool] = {}  # optimizer -> the lean statistics' snapshot buffers
        self._sampled_pools: dict[int, SampledPool] = {}  # the same, for statistics from samples (stats_sample)
        self._lean_plans: dict[int, _LeanPlan] = {}  # optimizer -> its lean steps' plan for the current layout
        self._total_norms: dict[int, TotalNorm] = {}  # optimizer -> the buffer its backward-pass norm reuses
        self._records = 0  # records written at the cadences (the flight recorder counts its dumps)
        self._full_records = 0  # of those, full-tensor records
        self._stats_steps = 0  # steps whose statistics were written
        self._logged: dict[str, object] = {}  # rec.log() values waiting for the next optimizer step
        self._scalar_rows: dict[int, list] = {}  # optimizer -> [(step, wall_time, {name: value})] not yet written
        self._last_stepped: int | None = None  # the optimizer that completed a step last (rec.log(after_step=True))
        self._backward_norms: dict[int, torch.Tensor] = {}  # optimizer -> total gradient norm after backward
        self._norm_queued = False  # a callback at the end of the backward pass in progress is queued
        self._step_scalars: dict[int, dict] = {}  # optimizer -> scalars the recorder measured in the step in progress
        self._closure_evaluated_once: set[int] = set()  # optimizers whose step(closure) evaluated its closure
        self._job_scalars: JobScalars | None = None

        if os.path.isdir(self.path):
            raise IsADirectoryError(f"{self.path} is a directory; upd.record writes one file: pass a file path, "
                                    f"e.g. {os.path.join(self.path, 'run.h5')}")
        try:
            model, job_optimizers, optimizers, global_names = self._attach(model, optimizer, ranks)
        except TypeError as exc:
            self._cannot_record(exc)
            return
        recording_here = self.rank_setup is None or self.rank_setup.records
        if recording_here and self.rank_setup:
            self.path = self.rank_setup.file
        holder = _recording_to(self.path) if recording_here else None
        if holder is not None:
            # A notebook cell run again while its first recorder is still open: HDF5 would refuse the file with its
            # own text and leave a dead recorder; say which recorder holds it instead.
            self._cannot_record(RuntimeError(
                f"{holder!r} in this process is still recording to this file; close it first (rec.close(), or "
                "record inside `with upd.record(...)`), or record to another path"))
            return
        self.optimizers = optimizers
        self.zero_counts = zero_counts
        self.spike_factor = spike_factor
        self.include = patterns(opts.include)
        self.exclude = patterns(opts.exclude)
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
            self._names = [ParamNames({**names_of_places, **names_in_model}) for names_of_places in global_names]
            opt_metas = [self._optimizer_meta(i, opt) for i, opt in enumerate(optimizers)]
            # A ZeRO rank's local optimizer holds its partition only; the job's optimizer holds them all.
            optimized = {id(p) for opt in job_optimizers for g in opt.param_groups for p in g["params"]}
            not_optimized = None if model is None else [
                name for name, p in named_parameters(model) if id(p) not in optimized]
        except Exception as exc:
            self._cannot_record(exc)
            return
        self._warn_if_nothing_selected(opt_metas)

        role = distributed.sink_role(self.rank_setup) if sinks or tensorboard is not None or self._alerts else None
        if role == SINKS_OWN or (role == SINKS_JOB and self.rank_setup.rank == 0):
            if tensorboard is not None:  # only the process that writes makes a SummaryWriter
                sinks = [TensorBoard(tensorboard), *sinks]
            # A split job's rank 0 feeds the job's combined statistics (_feed_job_step), not its own part's.
            self._sinks = SinkFeed(sinks, self._warn_sink, alerts=self._alerts)
        if role == SINKS_JOB and self._alerts is not None and self.rank_setup.rank == 0:
            warnings.warn("torch-upd: alerts= is not checked in a job whose ranks hold parts of the parameters (this "
                          "version); recording goes on without it.", RecorderWarning, stacklevel=3)
        # A split job's live statistics: every rank adds its parts' statistics, rank 0 feeds the sinks (job_scalars).
        if role == SINKS_JOB:
            self._job_scalars = JobScalars(self.rank_setup.rank, self.rank_setup.world_size, stats_every,
                                           list(self._steps_done), self._slots, self._warn_job_scalars)
        if not recording_here:
            return  # another rank records: no file, no hooks, nothing to close

        if self.rank_setup is not None:
            self.stats_sample = stats_sample = None  # a job's statistics are its local parts' exact ones
        meta = {
            "upd_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "created_unix": time.time(),
            "argv": list(sys.argv),
            "options": opts.stored(stats_every=stats_every, stats_sample=stats_sample, include=self.include,
                                   exclude=self.exclude),
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
            # Single-process sinks are fed from the writer thread, with the records it has written.
            feed = {"on_written": self._sinks.records_written} if self._sinks is not None and self._job_scalars is None \
                else {}
            self._writer = AsyncRunWriter(self.path, meta, overwrite=overwrite, storage_dtype=dtype,
                                          compression=compression, resume=resume, max_pending=2,
                                          before_full_write=wait_for_copies, **feed)
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
        if self._alerts is not None:
            self._alerts.store = self._writer.events_writer()
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

    def _attach(self, model, optimizer, ranks) -> tuple:
        """What the recorder attaches to, looked through every wrapper (``attaching.attach``, the wrapper
        registry): (the model whose names the run uses, the job's optimizers, the local optimizers whose hooks fire,
        each optimizer's names by place). Sets ``rank_setup``; TypeError for what cannot be recorded."""
        attached = attach(self.path, model, optimizer, ranks)
        self.rank_setup = attached.rank_setup
        return attached.model, attached.job_optimizers, attached.optimizers, attached.global_names

    def _warn_if_nothing_selected(self, opt_metas: list) -> None:
        """include=/exclude= that match no parameter record no tensor: a typo ("*.wieght") would go unnoticed until
        the run is analyzed, with nothing in it. Warned once, at setup, with the names there are."""
        if not (self.include or self.exclude):
            return
        names = [p["name"] for meta in opt_metas for p in meta["params"]]
        if names and not any(is_selected(name, self.include, self.exclude) for name in names):
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            warnings.warn(f"torch-upd: include={self.include} exclude={self.exclude} match none of the parameters "
                          f"({shown}): {self.path} will hold no parameter. Check the patterns (glob, on these "
                          "names).", RecorderWarning, stacklevel=4)

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
        # requires_grad=False: a frozen parameter the optimizer holds; it gets no gradient, hence no rows, and
        # readers list it as frozen rather than let it vanish.
        return [{"name": names.name(p, g, i, group), "shape": list(p.shape), "group": g,
                 **({} if p.requires_grad else {"requires_grad": False})}
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
        dropped = self._writer.truncate_from(index, self._steps_done[index])  # a checkpoint older than the run
        if truncation_text(self.path, index, self._steps_done[index], dropped):
            warnings.warn(truncation_text(self.path, index, self._steps_done[index], dropped), RecorderWarning, 4)

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
            if not self._norm_queued and self.active and self.rank_setup is None:
                self._norm_queued = queue_after_backward(self._backward_ended_eagerly)

        self._handles.append(param.register_post_accumulate_grad_hook(eager(count)))

    def add_earlier_backward_passes(self, counts: dict[int, int]) -> None:
        """Backward passes counted before this recorder was made (``id(parameter) -> count``), added to its own
        counts: ``upd record`` attaches at the first optimizer step, after the first backward passes."""
        for key, count in counts.items():
            if key in self._backward_counts:
                self._backward_counts[key] += count

    @functools.cached_property
    def _backward_ended_eagerly(self):
        # Made on first use, not with the class: torch.compiler.disable imports dynamo (about 1.7 s), which a
        # process that only reads runs (`upd info`) should not pay.
        return eager(self._backward_ended)

    def _backward_ended(self) -> None:
        """The end of a backward pass (an autograd callback, see grad_norms): the total gradient norm of each
        optimizer whose next step is recorded, before anything between backward and step can change it."""
        self._norm_queued = False
        if self.active:
            self._guard(self._measure_backward_norms)

    def _measure_backward_norms(self) -> None:
        for i, opt in enumerate(self.optimizers):
            if any(self._cadence(self._steps_done[i])):
                norm = self._total_norms.setdefault(i, TotalNorm())(_gradients(opt))
                if norm is not None:
                    self._backward_norms[i] = norm

    def _measure_step_norms(self, opt_index: int, optimizer: torch.optim.Optimizer) -> None:
        """The total gradient norm as the step sees it, next to the one the last backward pass left (a clipped step
        shows as the first smaller than the second); launched on the device, read with the step's scalars."""
        if self.rank_setup is not None:
            return  # a rank's gradients are a part, or not yet reduced when its backward pass ends
        if not any(self._cadence(self._steps_done[opt_index])):
            return  # a step the flight recorder keeps in memory only: it writes nothing while training is healthy
        scalars = self._step_scalars.setdefault(opt_index, {})
        backward = self._backward_norms.pop(opt_index, None)
        if backward is not None:
            scalars[schema.SCALAR_GRAD_NORM_BACKWARD] = backward
        seen = total_norm(_gradients(optimizer))
        if seen is not None:
            scalars[schema.SCALAR_GRAD_NORM_AT_STEP] = seen

    def _cadence(self, step: int) -> tuple[bool, bool]:
        """(selected by every=, a statistics step) for an optimizer step."""
        return (self.every is not None and step % self.every == 0,
                self.stats_every is not None and step % self.stats_every == 0)

    def _backward_passes(self, optimizer: torch.optim.Optimizer) -> int:
        """Backward passes so far: the most any of the optimizer's parameters saw (a parameter without a gradient in
        some passes saw fewer)."""
        return max((self._backward_counts.get(id(p), 0) for g in optimizer.param_groups for p in g["params"]),
                   default=0)

    # -- hooks ------------------------------------------------------------------------------------------------
    def _make_pre_hook(self, opt_index: int):
        def pre_hook(optimizer, args, kwargs):
            if not self.active:
                return None
            # args is (optimizer, *step_args): a closure is step's first positional argument or `closure=`.
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
            self._step_scalars[opt_index] = {}
            self._closure_evaluated_once.discard(opt_index)
            if closure is None:
                self._norm_queued = False  # a backward pass that raised never ran its callback: queue anew
            self._guard(self._before_step, opt_index, optimizer, closure is not None)
            if closure is None or not self.active:
                return None
            wrapped = self._wrap_closure(opt_index, closure)
            if len(args) > 1:
                return (args[0], wrapped, *args[2:]), kwargs
            return args, dict(kwargs, closure=wrapped)
        return eager(pre_hook)

    def _wrap_closure(self, opt_index: int, closure):
        """Closure-driven optimizers (LBFGS, and Lightning's automatic optimization) compute the gradient inside
        step(): capture the first evaluation's loss (at the parameters before the step) as the step's logged loss,
        and at recorded steps its gradient, its total norms and every evaluation's loss."""
        @eager
        def record_evaluation(loss):
            if self.active:
                self._guard(self._closure_evaluated, opt_index, loss)

        def recording_closure(*args, **kwargs):
            loss = closure(*args, **kwargs)  # the user's closure: compiled if the step is
            record_evaluation(loss)
            return loss
        return recording_closure

    def _closure_evaluated(self, opt_index: int, loss) -> None:
        first = opt_index not in self._closure_evaluated_once
        self._closure_evaluated_once.add(opt_index)
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        scalars = self._step_scalars.setdefault(opt_index, {})
        if first and value is not None and scalar_problem(value) is None:
            scalars[schema.SCALAR_LOSS] = value  # read with the step's other scalars: no synchronisation here
        pending = self._pending.get(opt_index)
        if pending is None:
            return
        if first:
            self._measure_step_norms(opt_index, self.optimizers[opt_index])
        losses = pending.record.closure_losses
        losses.append(float(value) if value is not None else float("nan"))
        if first:
            # The step's gradient is the first evaluation's, and its backward pass ran inside step(), after the
            # pre-hook counted: counted again here, or every step(closure) (Lightning's automatic optimization
            # steps so) would read one backward pass short.
            pending.record.backward_pass = self._backward_passes(self.optimizers[pending.record.optimizer])
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
        engine = statistics_set(step, stats_every=self.stats_every, full_stats_every=self.full_stats_every,
                                full_record=full, stats_sample=self.stats_sample)
        with_stats, lean = engine is not None, engine in (LEAN, SAMPLED)
        if not (full or with_stats):
            return
        if lean and self._start_lean_step(opt_index, optimizer, step, closure_step, engine == SAMPLED):
            return
        if not closure_step:  # a closure's gradient exists only inside step(): measured at its first evaluation
            self._measure_step_norms(opt_index, optimizer)
        params = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = names[p]
                # The optimizer skips a parameter without a gradient, so there is nothing to record for it; with a
                # closure the gradient appears only inside step(), so that is decided after the step.
                if (p.grad is None and not closure_step) or not is_selected(name, self.include, self.exclude):
                    continue
                # DTensor gradients and state are stored as the parameter's part. Checked when the parameter or its
                # gradient is one (optimizer state is made like the parameter): not per tensor of every model.
                if dtensor is not None and (isinstance(p, dtensor) or isinstance(p.grad, dtensor)):
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
                elif not lean:
                    # Statistics only: the one snapshot the update needs, kept on the parameter's device and freed
                    # after the step (the lean set copies into buffers it keeps instead).
                    tracked.before = local_part(p.detach()).clone()
                params.append(tracked)
        backward = self._backward_passes(optimizer)
        stats = self._lean_statistics(opt_index, params) if lean else None
        if with_stats and stats is None:
            stats = StepStatistics(self.zero_counts)
            if not full:
                self._launch_stats_before_step(stats, params, optimizer, closure_step)
        record = Record(optimizer=opt_index, step=step, backward_pass=backward, wall_time=time.time(),
                        hparams=[hparams_snapshot(g) for g in optimizer.param_groups],
                        params=[t.snapshot for t in params] if full else [],
                        closure_losses=[] if closure_step else None, full=full)
        self._pending[opt_index] = _StepInProgress(record=record, params=params, selected=selected,
                                                   closure=closure_step, stats=stats)

    def _start_lean_step(self, opt_index: int, optimizer: torch.optim.Optimizer, step: int,
                         closure_step: bool = False, sampled: bool = False) -> bool:
        """A lean statistics step of a single-process run, started from the layout's _LeanPlan: the statistics
        launched before the step and the total gradient norm as the step sees it taken from their per-gradient norms
        (no pass of its own). False, having done nothing, where the general path must take the step: DTensors,
        tensors the lean set does not take (lean_applies), no parameter with a gradient. A step(closure) has no
        gradient yet: the parameters are copied now and the gradients reduced after the step (LeanStep with
        grads=None, exact statistics whatever stats_sample says), and the step's total norm is taken when the
        closure is first evaluated, as on the general path."""
        if self.rank_setup is not None:
            return False
        layout = self._layouts[opt_index]
        plan = self._lean_plans.get(opt_index)
        if plan is None or plan.layout is not layout:
            plan = self._lean_plan(optimizer, self._names[opt_index], layout)
            if plan is None:
                return False
            self._lean_plans[opt_index] = plan
        tracked, live, names, stats_meta = plan.tracked, plan.live, plan.names, plan.stats_meta
        if closure_step:
            if not lean_applies(live, live):  # the parameters alone: their gradients come inside the step
                return False
            stats = LeanStep(self._stats_pools.setdefault(opt_index, SnapshotPool()), names, live, live, None)
        else:
            grads = [p.grad for p in live]
            if any(g is None for g in grads):  # skipped by the optimizer (a frozen parameter): not recorded either
                tracked = [t for t, g in zip(tracked, grads) if g is not None]
                live, names = [t.live for t in tracked], [t.snapshot.name for t in tracked]
                stats_meta = {name: stats_meta[name] for name in names}
                grads = [g for g in grads if g is not None]
            dtensor = dtensor_class()
            if not lean_applies(live, grads) or (dtensor is not None and any(isinstance(g, dtensor) for g in grads)):
                return False
            if sampled:  # single-process runs only: a DTensor's local parts get the exact set
                stats = SampledStep(self._sampled_pools.setdefault(opt_index, SampledPool(self.stats_sample)),
                                    names, live, grads)
            else:
                stats = LeanStep(self._stats_pools.setdefault(opt_index, SnapshotPool()), names, live, live, grads)
            scalars = self._step_scalars.setdefault(opt_index, {})
            backward = self._backward_norms.pop(opt_index, None)
            if backward is not None:
                scalars[schema.SCALAR_GRAD_NORM_BACKWARD] = backward
            scalars[schema.SCALAR_GRAD_NORM_AT_STEP] = (stats.grad_norm if plan.all_selected else
                                                        total_norm(_gradients(optimizer)))
        record = Record(optimizer=opt_index, step=step, backward_pass=self._backward_passes(optimizer),
                        wall_time=time.time(), hparams=[hparams_snapshot(g) for g in optimizer.param_groups],
                        params=[], closure_losses=[] if closure_step else None, full=False)
        self._pending[opt_index] = _StepInProgress(record=record, params=tracked, selected=False,
                                                   closure=closure_step, stats=stats, stats_meta=stats_meta)
        return True

    def _lean_plan(self, optimizer: torch.optim.Optimizer, names: ParamNames, layout: tuple) -> _LeanPlan | None:
        """The selected parameters of this layout, named, with their metadata; None when one is a DTensor."""
        dtensor = dtensor_class()
        tracked, all_selected = [], True
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = names[p]
                if not is_selected(name, self.include, self.exclude):
                    all_selected = False
                    continue
                if dtensor is not None and isinstance(p, dtensor):
                    return None
                tracked.append(_TrackedParam(live=p, snapshot=ParamSnapshot(name=name, group=g, index_in_group=i)))
        return _LeanPlan(layout=layout, tracked=tracked, live=[t.live for t in tracked],
                         names=[t.snapshot.name for t in tracked], all_selected=all_selected,
                         stats_meta={t.snapshot.name: param_meta(t.snapshot, t.live) for t in tracked})

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

    def _lean_statistics(self, opt_index: int, params: list[_TrackedParam]) -> LeanStep | None:
        """The lean set launched before the step (device_stats.LeanStep); None where it does not apply, after taking
        the snapshots the full set's path needs instead."""
        live = [t.live for t in params]
        parts = [local_part(p.detach()) for p in live]
        grads = [local_part(p.grad) for p in live]
        if lean_applies(parts, grads):
            pool = self._stats_pools.setdefault(opt_index, SnapshotPool())
            return LeanStep(pool, [t.snapshot.name for t in params], live, parts, grads)
        for tracked, part in zip(params, parts):
            tracked.before = part.clone()
        return None

    def _after_step(self, opt_index: int, optimizer: torch.optim.Optimizer) -> None:
        step = self._steps_done[opt_index]
        self._steps_done[opt_index] += 1
        self._last_stepped = opt_index
        pending = self._pending.pop(opt_index, None)
        self._queue_scalars(opt_index, step, pending.record.wall_time if pending is not None else time.time())
        if pending is None:
            if len(self._scalar_rows.get(opt_index, ())) >= HOST_BATCH_STEPS:
                self._write_scalars(opt_index)
            return
        rec = pending.record
        if pending.closure and "grad" in self.what and rec.full:
            # Parameters the closure gave no gradient were skipped by the optimizer, as in a plain step.
            pending.params = [t for t in pending.params if t.snapshot.grad is not None]
            rec.params = [t.snapshot for t in pending.params]
        if pending.stats is not None:
            rec.stats = pending.stats.after_step(pending)  # one device-to-host copy, whichever engine
            rec.stats_meta = pending.stats_meta if pending.stats_meta is not None else {
                t.snapshot.name: param_meta(t.snapshot, local_part(t.live)) for t in pending.params}
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
        if selected:  # a full record is written now, its tensors copied to the host: the scalars go with it
            rec.scalars = self._scalars_on_host(opt_index)
        elif rec.stats is not None and self._sinks is not None and self._sinks.sinks:
            # The sinks get a step's statistics and its scalars together: read now, the device is idle by now.
            rec.scalars = self._scalars_on_host(opt_index)
        elif len(self._scalar_rows.get(opt_index, ())) >= HOST_BATCH_STEPS:
            # A statistics step read its one host copy already: the scalars wait for a full record, or until
            # HOST_BATCH_STEPS steps wait (one more copy per that many steps, of a device that is idle by now).
            if rec.stats is not None:
                rec.scalars = self._scalars_on_host(opt_index)
            else:
                self._write_scalars(opt_index)
        if self._flight is None:
            self._writer.write(rec)
        else:
            self._flight.step(rec, selected)
        if self._flight is None or selected:
            self._records += 1
            self._full_records += bool(selected)
        self._stats_steps += rec.stats is not None
        if self._alerts is not None:
            self._act_on_alerts()

    # -- logged scalars ---------------------------------------------------------------------------------------
    def log(self, after_step: bool = False, **scalars) -> None:
        """Store per-step scalars in the run: ``rec.log(loss=loss, accuracy=acc)``.

        Values are numbers or 1-element tensors (any device; kept detached, and read to the host when a full
        record is written, with its copies, else once 64 steps wait, and at close: logging never waits for the
        device; a crash loses the values still waiting). Each value belongs
        to the next optimizer step to complete, so call it between the forward pass and ``optimizer.step()``;
        with ``after_step=True`` it belongs to the step completed last (log after ``optimizer.step()``). With
        several optimizers, to the one that steps next (or stepped last). Logging a name again before that step
        replaces the value. ``run.steps()`` and ``run.scalars()`` show them; ``tensorboard=`` writes them live as
        ``scalars/<name>``. A value that is not one number, or a reserved name, raises (TypeError, ValueError).
        """
        for name, value in scalars.items():
            problem = name_problem(name)
            if problem:
                raise ValueError(f"rec.log: {name!r} is {problem}; choose another name")
            problem = scalar_problem(value)
            if problem:
                raise TypeError(f"rec.log: {name}= is {problem}")
        if not self.active or not scalars:
            return
        values = {name: kept(value) for name, value in scalars.items()}
        if not after_step or self._last_stepped is None:  # before any step: it can only belong to the first one
            self._logged.update(values)
            return
        opt_index = self._last_stepped
        step = self._steps_done[opt_index] - 1
        rows = self._scalar_rows.setdefault(opt_index, [])
        if rows and rows[-1][0] == step:
            rows[-1][2].update(values)
        else:  # the step's row was written already (or it logged nothing): a second row, merged by readers
            rows.append((step, time.time(), values))

    def _queue_scalars(self, opt_index: int, step: int, wall_time: float) -> None:
        """The values logged for this step, and those the recorder measured in it, wait for the host copy."""
        values = self._step_scalars.pop(opt_index, {})
        values.update(self._logged)  # rec.log(loss=...) wins over the closure's loss
        self._logged = {}
        if values:
            self._scalar_rows.setdefault(opt_index, []).append((step, wall_time, values))

    def _scalars_on_host(self, opt_index: int) -> list:
        """The optimizer's waiting scalar rows read to the host (one copy per device). A split job's rank 0 keeps
        them for its sinks too, which get them with the job's statistics (the file's records carry rank 0's part)."""
        rows = self._scalar_rows.pop(opt_index, [])
        if not rows:
            return []
        rows = to_host(rows)
        if self._sinks is not None and self._job_scalars is not None:
            self._live_rows.setdefault(opt_index, []).extend(rows)
        return rows

    def _write_scalars(self, opt_index: int) -> None:
        """Write the optimizer's waiting scalar rows without a record."""
        rows = self._scalars_on_host(opt_index)
        if rows:
            self._writer.write(Record(optimizer=opt_index, step=rows[-1][0], backward_pass=0, wall_time=rows[-1][1],
                                      hparams=[], params=[], full=False, scalars=rows))

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
            cached = (layout, [Slot(name, name) for name in recorded
                               if is_selected(name, self.include, self.exclude)])
            self._job_slots[opt_index] = cached
        return cached[1]

    def _share_job_scalars(self, opt_index: int) -> None:
        """Join the statistics step's all-reduce (outside ``_guard``: a SIGTERM must still end a process waiting in
        it); rank 0 writes the result. JobScalars raises nothing; writing is a recorder error like any other."""
        parts = self._job_parts.pop(opt_index, None)
        combined = self._job_scalars.after_step(opt_index, parts if self.active else None)
        if self._sinks is not None and self.active and (combined is not None or opt_index in self._live_rows):
            self._guard(self._feed_job_step, opt_index, combined)

    def _feed_job_step(self, opt_index: int, combined: tuple | None) -> None:
        """Hand rank 0's sinks the job's whole-parameter statistics of this step (when it had them) with the scalar
        rows read so far, on the writer thread."""
        steps = [SinkStep(optimizer=opt_index, step=step, wall_time=wall, scalars=values)
                 for step, wall, values in self._live_rows.pop(opt_index, [])]
        if combined is not None:
            step, slots, summed = combined
            own = [s for s in steps if s.step == step]
            steps = [s for s in steps if s.step != step]
            scalars = {name: value for s in own for name, value in s.scalars.items()}
            steps.append(SinkStep(optimizer=opt_index, step=step, wall_time=own[0].wall_time if own else time.time(),
                                  params=job_scalars.scalars(slots, summed), scalars=scalars))
        if steps:
            self._writer.run_later(functools.partial(self._sinks.deliver, steps))

    def _warn_job_scalars(self, why: str) -> None:
        warnings.warn(f"torch-upd: the job's live statistics stop: {why}; training continues.",
                      RecorderWarning, stacklevel=2)

    def _act_on_alerts(self, closing: bool = False) -> None:
        """On the training thread: the alerts the writer thread found since the last step warned about, and the
        flight recorder's dump they asked for done (upd.recorder.alerts)."""
        texts, reason = self._alerts.take()
        for text in texts:
            warnings.warn(text, TrainingAlert, stacklevel=4)
        if reason is not None and self._flight is not None and not closing:
            self._flight.dump(reason)
        if closing and self._alerts.closing_text():
            warnings.warn(self._alerts.closing_text(), TrainingAlert, stacklevel=3)

    @staticmethod
    def _warn_sink(why: str) -> None:
        warnings.warn(why, RecorderWarning, stacklevel=2)

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
        """Remove every hook and close the file. Safe to call twice, and after recording stopped on an error.
        A recorder inherited through fork closes nothing: the file and its writer thread are the parent's."""
        if not lifetime.owned_here(self):
            self.active = False
            return
        was_active = self.active
        if was_active:
            for opt_index in list(self._scalar_rows):
                self._guard(self._write_scalars, opt_index)
            if self._job_scalars is not None and self._sinks is not None:
                for opt_index in list(self._live_rows):
                    self._guard(self._feed_job_step, opt_index, None)
            if self._alerts is not None and self.active:  # the last steps' alerts, dumps included, before the end
                self._guard(self._writer.sync)
                self._guard(self._act_on_alerts)
            was_active = self.active  # a write that failed stopped recording
        self.active = False
        self._remove_hooks()
        self._pending.clear()
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
            finally:
                self._close_sinks()
                if self._alerts is not None:  # the last records' alerts, checked as the writer drained
                    self._act_on_alerts(closing=True)
        else:
            self._close_sinks()

    def _close_sinks(self) -> None:
        """Every sink closed once, after the writer thread has fed them the last records; those this process did
        not feed (another rank writes the job's live values) closed unused."""
        feed, self._sinks = self._sinks, None
        if feed is not None:
            feed.close()
        else:
            close_unused(self._given_sinks, self._warn_sink)
        self._given_sinks = []

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def full_records(self) -> int:
        """Full-tensor records committed so far (what ``upd info`` counts as records), flight-recorder dumps
        included."""
        return self._full_records + (self._flight.records_dumped if self._flight is not None else 0)

    def __repr__(self) -> str:
        state = "recording" if self.active else "closed"
        if self.rank_setup is not None and not self.rank_setup.records:
            state = f"not recording on rank {self.rank_setup.rank}"
        return (f"<upd.Recorder {self.path!r} {state}, {self.full_records} full-tensor records"
                + (f", {self._stats_steps} statistics steps" if self.stats_every is not None else "") + ">")


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's gradients (of a DTensor, the local part: the whole of it when one process holds it all)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return grads if dtensor_class() is None else [local_part(g) for g in grads]




def _recording_to(path: str) -> "Recorder | None":
    """The active recorder of this process that writes `path`, if any."""
    try:
        real = os.path.realpath(path)
    except OSError:
        return None
    for recorder in list(lifetime.recorders):
        if recorder.active and os.path.realpath(recorder.path) == real:
            return recorder
    return None


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
        every: write the full tensors (parameter before and after, gradient, optimizer state) every N-th optimizer
            step (default 1: every step; None: never, e.g. with ``stats_every``).
        stats_every: write summary statistics (mean, std, norm, abs max, zeros, NaN/Inf count of each parameter,
            gradient, update and state tensor; update:data and grad:data) every N-th step, computed on the training
            device with one host copy per step (default None: never; 1 when ``tensorboard`` is given).
        sinks: live outputs beside the file, objects with ``write(steps)`` and ``close()`` (``upd.sinks.Sink``;
            ``upd.sinks.TensorBoard``, or your own): each gets every statistics step's per-parameter statistics and
            the logged scalars, together, as ``upd.sinks.SinkStep``s, on the run file's writer thread (never the
            training thread), and is closed with the recorder (``stats_every`` defaults to 1 then). A sink that
            raises is warned about once and dropped; training and the file go on. In a distributed job rank 0 alone
            feeds its sinks, the whole parameters' values (the other ranks' sinks are closed unused). Where each
            rank holds a part of the model (FSDP2, ZeroRedundancyOptimizer), every rank joins one all-reduce of a
            small float64 tensor per statistics step (15 numbers per parameter and one per rank), in the
            optimizer's post-step hook; replicated training (DDP) needs none. Every rank must then make the same
            call, with sinks, the same ``stats_every``, and close its recorder at the same point. A recorder error
            on one rank stops the live values on every rank at the next statistics step, never the training.
            Refused for a sharded job recorded on one rank only (``ranks=`` an int): its shards' ratios are not the
            parameters'.
        tensorboard: a ``torch.utils.tensorboard.SummaryWriter`` or a log dir: shorthand for
            ``sinks=[upd.sinks.TensorBoard(tensorboard)]`` (made on the writing rank only): ``update_to_data/<param>``,
            ``grad_to_data/<param>``, the update, gradient and parameter norms and ``scalars/<name>``, live.
        include / exclude: glob pattern(s) on parameter names, e.g. ``include="*.weight"`` (default None: every
            parameter). Patterns that match no parameter warn at this call.
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
            "state" (default: gradients only; counting is the slowest statistic on CPU, 4x a sum). Zero fractions
            belong to the full statistics set (``full_stats_every``).
        full_stats_every: statistics steps compute the lean set by default: mean, std, norm and NaN/Inf count of
            every parameter, its gradient and its update, so update:data and grad:data (two reductions per tensor,
            cheaper than a hand-written clone-and-std() loop). Every ``full_stats_every``-th step (default 100; a
            multiple of ``stats_every``, or the two rarely coincide) that is a statistics step computes the full set
            instead: also abs max, fractions of zeros (``zero_counts``) and the statistics of every optimizer-state
            tensor. ``1``: the full set at every statistics step; ``None``: never. Statistics at a step with full
            tensors (``every=``) are always the full set.
        stats_sample: ``None`` (default): exact statistics. An int K >= 256 (4096 recommended): at lean statistics
            steps, the mean, std and norm of each parameter and update of more than K elements, and its gradient's
            mean, are estimated from K fixed element positions (the gradient's norm, its NaN/Inf count and, nearly,
            its std stay exact), so a step's cost no longer grows with the tensors; smaller tensors and full-set
            steps stay exact. The run's options record K; the error on real runs is in docs/performance.md. For
            models where even the exact lean set is too slow; single-process runs (a distributed job records the
            exact set, and its options say stats_sample=None).
        flight_recorder: keep the last K steps' full tensors in memory (no disk I/O while nothing happens) and
            write them to the run when a trigger fires: a NaN/Inf in a gradient or update, a gradient- or
            update-norm spike above ``spike_factor`` (default 10) times its recent median, or ``rec.dump(reason)``.
            The reasons are stored (``Run.dumps``); the dumped steps replay and verify like any others.
        spike_factor: the flight recorder's trigger: a gradient or update norm above this many times its recent
            median (default 10; must be > 1).
        alerts: early warnings (``True``, or an ``upd.alert_rules.AlertRules`` with other thresholds): each
            statistics step is checked on the writer thread, from the values already on the host, for a weight
            leaving the update:data band, an update-norm spike, NaN/Inf (and the other rules of docs/diagnosis.md).
            A new alert is an ``upd.TrainingAlert`` warning (rate-limited: once per kind and weight, at most 10,
            then one saying the rest are stored), an entry of the run's events (``Run.events``), ``alerts/<kind>``
            counts in every sink, and with ``flight_recorder=K`` a NaN/Inf or spike alert dumps the kept steps.
            Implies statistics at every step unless ``stats_every`` says.
        strict: raise recorder errors (at setup too) instead of warning once and stopping recording.
        ranks: which ranks of a distributed job record (ignored in a single process). ``None`` (default): every
            rank when each holds a part of the model (FSDP2 shards, ZeroRedundancyOptimizer partitions), rank 0
            alone otherwise (DDP and other replicated training: the replicas are identical), into `path` itself.
            ``"all"``: every rank, one file each (``upd verify`` then also checks that the replicas agree). An
            int: that rank only. Other ranks get an inactive recorder (``rec.active`` is False): no file, no hooks.
            With ``resume=True`` each rank resumes its own file; the job must have the same number of processes.

    The returned ``Recorder`` also stores per-step scalars: ``rec.log(loss=loss)`` (see ``Recorder.log``), and
    logs, at each recorded step, the total gradient norm as the backward pass left it and as the step saw it
    (clipping shows as the second smaller: ``upd info`` says on how many steps).
    """
    return Recorder(path, model, optimizer, **options)


_LEADING = [inspect.Parameter("path", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
              for name in ("model", "optimizer"))]
# help(upd.record), inspect and notebooks show every option with its default, from RecordOptions.
record.__signature__ = record_signature(*_LEADING)
Recorder.__init__.__signature__ = record_signature(inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                                   *_LEADING)
