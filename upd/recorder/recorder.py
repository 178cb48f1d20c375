"""The recorder: attaches to optimizers through torch's step pre/post hooks and writes what each step did.

This module holds the hooks, the never-break-training guard and the recorder's lifecycle (the writer, the sinks,
the process's registry of recorders). What one optimizer's steps need (its names, the step in progress, its
statistics' buffers, its waiting scalars) is its ``track.OptimizerTrack``; the options are ``options.RecordOptions``.
What reaches the writer is a ``upd.runfile.record.Record``.

Counts, with one meaning each across the recorder and the reader (``Run``, ``OptimizerRun``, ``Job``):

- a *step* is one ``optimizer.step()`` call, numbered from the optimizer's own step counter, recorded or not; a
  *statistics step* is one whose statistics were written (``repr(rec)``); ``run.steps()`` shows one row per step
  the file holds anything of (full tensors, statistics or logged scalars);
- a *record* is one row of an optimizer's record table in the file: a step's full tensors (``Recorder.full_records``,
  ``OptimizerRun.num_records``, what ``upd info`` counts as records, the rows a parameter's ``records`` index);
  ``Recorder.records`` counts the steps written so far, with full tensors or statistics only;
- a *dump* is one flight-recorder trigger that wrote the steps it kept, as records (``Recorder.dumps``,
  ``Run.dumps()``, ``Job.dumps()`` with each rank's).
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings

import torch

from .. import lifetime
from ..runfile import schema
from ..runfile.async_writer import AsyncRunWriter
from ..sinks.feed import SINKS_JOB, SINKS_OWN, SinkFeed, close_unused, sink_problem
from ..sinks.tensorboard import TensorBoard
from . import distributed, job_scalars
from .alerts import LiveAlerts
from .attaching import attach
from .backward import BackwardCounts, eager
from .flight_recorder import FlightRecorder
from .grad_norms import queue_after_backward
from .job_scalars import JobScalars
from .logged_scalars import HOST_BATCH_STEPS, check_logged, kept
from .options import RecordOptions, documented_options, record_signature
from .naming import ParamNames, model_names, named_parameters, patterns, unmatched_patterns
from .resume import continued_step, initial_step, truncation_text
from .run_meta import run_meta
from .snapshots import wait_for_copies
from .track import OptimizerTrack, TrackSettings


class RecorderWarning(UserWarning):
    """The recorder stopped recording; training goes on."""


class TrainingAlert(RecorderWarning):
    """A live alert (``upd.record(..., alerts=True)``): a weight left the band, an update norm spiked, NaN/Inf."""


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
        # live values come from the statistics: at every step unless stats_every says
        stats_every = 1 if opts.live() and opts.stats_every is None else opts.stats_every

        # An inactive recorder from here on: everything below that cannot record returns it as it is (one
        # RecorderWarning, no hooks, no file), so that setup never breaks the training either.
        self.path = os.fspath(path)
        self.options = opts
        self.rank_setup = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.every, self.stats_every, self.flight_recorder = opts.every, stats_every, opts.flight_recorder
        self.strict = opts.strict
        self.include, self.exclude = patterns(opts.include), patterns(opts.exclude)
        self.active = False
        self.error: BaseException | None = None
        self._flight: FlightRecorder | None = None  # made with the writer it dumps to
        self._sinks: SinkFeed | None = None  # the sinks this process feeds (sink_role)
        self._alerts = LiveAlerts(opts.alerts, dump=opts.flight_recorder is not None) if opts.alerts else None
        self._given_sinks = list(opts.sinks)  # closed with the recorder, fed or not
        self._handles = []
        self._tracks: list[OptimizerTrack] = []  # one per optimizer, in the run's order
        self._backward = BackwardCounts(self._backward_counted, self._handles)
        self._records = 0  # steps written at the cadences (the flight recorder counts its dumps)
        self._full_records = 0  # of those, full-tensor records
        self._stats_steps = 0  # steps whose statistics were written
        self._logged: dict[str, object] = {}  # rec.log() values waiting for the next optimizer step
        self._last_stepped: OptimizerTrack | None = None  # completed a step last (rec.log(after_step=True))
        self._norm_queued = False  # a callback at the end of the backward pass in progress is queued
        self._job_scalars: JobScalars | None = None

        if os.path.isdir(self.path):
            raise IsADirectoryError(f"{self.path} is a directory; upd.record writes one file: pass a file path, "
                                    f"e.g. {os.path.join(self.path, 'run.h5')}")
        try:
            model, job_optimizers, optimizers, global_names = self._attach(model, optimizer, opts.ranks)
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
        # opts.live(): sinks, tensorboard= or alerts= (checked on the writer thread, by the SinkFeed).
        role = distributed.sink_role(self.rank_setup) if opts.live() else None
        feeds_sinks = role == SINKS_OWN or (role == SINKS_JOB and self.rank_setup.rank == 0)
        # Alerts alone read the statistics the writer gets anyway: no extra scalar host copy per statistics step.
        has_sinks = bool(self._given_sinks) or opts.tensorboard is not None
        # A job's statistics are its local parts' exact ones: stats_sample is for single-process runs.
        stats_sample = None if self.rank_setup is not None else opts.stats_sample
        settings = TrackSettings(
            every=opts.every, stats_every=stats_every, full_stats_every=opts.full_stats_every,
            stats_sample=stats_sample, what=opts.what, zero_counts=opts.zero_counts, include=self.include,
            exclude=self.exclude, rank_setup=self.rank_setup, keeps_every_step=opts.flight_recorder is not None,
            feeds_sinks=feeds_sinks and has_sinks, shares_job_statistics=role == SINKS_JOB)
        try:
            # Everything the run's metadata needs from the model and the optimizers, read before the file exists:
            # an object that only looks like them fails here, and leaves no file behind.
            names_in_model = model_names(model)
            self._tracks = [OptimizerTrack(i, opt, job_opt, ParamNames({**names_of_places, **names_in_model}),
                                           initial_step(opt), settings, self._backward)
                            for i, (opt, job_opt, names_of_places)
                            in enumerate(zip(optimizers, job_optimizers, global_names))]
            opt_metas = [track.meta() for track in self._tracks]
            # A ZeRO rank's local optimizer holds its partition only; the job's optimizer holds them all.
            optimized = {id(p) for opt in job_optimizers for g in opt.param_groups for p in g["params"]}
            not_optimized = None if model is None else [
                name for name, p in named_parameters(model) if id(p) not in optimized]
        except Exception as exc:
            self._cannot_record(exc)
            return
        unmatched = unmatched_patterns([p["name"] for meta in opt_metas for p in meta["params"]], self.include,
                                       self.exclude)
        if unmatched:
            warnings.warn(f"torch-upd: {unmatched}: {self.path} will hold no parameter. Check the patterns (glob, on "
                          "these names).", RecorderWarning, stacklevel=3)

        if feeds_sinks:
            # Only the process that writes makes a SummaryWriter. A split job's rank 0 feeds the job's combined
            # statistics (_feed_job_step), not its own part's.
            given = self._given_sinks if opts.tensorboard is None else [TensorBoard(opts.tensorboard),
                                                                         *self._given_sinks]
            self._sinks = SinkFeed(given, self._warn_sink, alerts=self._alerts)
        if role == SINKS_JOB and self._alerts is not None and self.rank_setup.rank == 0:
            warnings.warn("torch-upd: alerts= is not checked in a job whose ranks hold parts of the parameters (this "
                          "version); recording goes on without it.", RecorderWarning, stacklevel=3)
        # A split job's live statistics: every rank adds its parts' statistics, rank 0 feeds the sinks (job_scalars).
        if settings.shares_job_statistics:
            self._job_scalars = JobScalars(self.rank_setup.rank, self.rank_setup.world_size, stats_every,
                                           [track.steps_done for track in self._tracks],
                                           lambda index: self._tracks[index].slots(), self._warn_job_scalars)
        if not recording_here:
            return  # another rank records: no file, no hooks, nothing to close

        meta = run_meta(opts.stored(stats_every=stats_every, stats_sample=stats_sample, include=self.include,
                                    exclude=self.exclude), len(optimizers), self.rank_setup)
        if self.rank_setup is not None:
            conflict = distributed.layout_conflict(self.rank_setup)
            if conflict:
                raise ValueError(f"{self.path}: cannot {'resume' if opts.resume else 'record'}: {conflict}")
        # Resuming appends to the user's file: a failure below never removes it. Any other file is this
        # recorder's own, removed again if setup fails after creating it: a stub would read as an empty run.
        existed = os.path.exists(self.path)
        ours = not (opts.resume and existed)
        # HDF5 writes happen on a writer thread behind a queue of 2 records: training waits only when the disk is
        # slower than training (+5% instead of +24% inline, docs/background.md).
        try:
            # Single-process sinks are fed from the writer thread, with the records it has written.
            feed = {"on_written": self._sinks.records_written} if self._sinks is not None and self._job_scalars is None \
                else {}
            self._writer = AsyncRunWriter(self.path, meta, overwrite=opts.overwrite, storage_dtype=opts.dtype,
                                          compression=opts.compression, resume=opts.resume, max_pending=2,
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
                for track in self._tracks:
                    self._handles.append(track.optimizer.register_step_post_hook(self._make_post_hook(track)))
            return
        if self._alerts is not None:
            self._alerts.store = self._writer.events_writer()
        if opts.flight_recorder is not None:
            self._flight = FlightRecorder(self._writer, len(optimizers), opts.flight_recorder, opts.spike_factor)
        try:
            if opts.resume:
                for track, opt_meta in zip(self._tracks, opt_metas):
                    step = continued_step(self._writer, self.path, track.index, track.optimizer, opt_meta)
                    track.steps_done = track.steps_done if step is None else max(track.steps_done, step)
                    # A checkpoint older than the run's last step: the steps after it were trained again.
                    dropped = self._writer.truncate_from(track.index, track.steps_done)
                    text = truncation_text(self.path, track.index, track.steps_done, dropped)
                    if text:
                        warnings.warn(text, RecorderWarning, 4)
        except BaseException:
            self._discard_writer(ours)
            raise  # a run that cannot be continued: the user's mistake, like an existing file without overwrite=
        try:
            for track, opt_meta in zip(self._tracks, opt_metas):
                self._writer.add_optimizer(track.index, opt_meta)
                self._handles.append(track.optimizer.register_step_pre_hook(self._make_pre_hook(track)))
                self._handles.append(track.optimizer.register_step_post_hook(self._make_post_hook(track)))
            for opt in optimizers:
                # Count from the very first backward pass: before the first step, accumulation and skipped steps
                # would otherwise be invisible.
                for group in opt.param_groups:
                    for p in group["params"]:
                        self._backward.hook(p)
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

    # -- the backward pass ------------------------------------------------------------------------------------
    def _backward_counted(self) -> None:
        """A parameter's gradient was accumulated: the end of this backward pass measures the total norms."""
        if not self._norm_queued and self.active and self.rank_setup is None:
            self._norm_queued = queue_after_backward(self._backward_ended_eagerly)

    def add_earlier_backward_passes(self, counts: dict[int, int]) -> None:
        """Backward passes counted before this recorder was made (``id(parameter) -> count``), added to its own
        counts: ``upd record`` attaches at the first optimizer step, after the first backward passes."""
        self._backward.add(counts)

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
        for track in self._tracks:
            track.backward_ended()

    # -- hooks ------------------------------------------------------------------------------------------------
    def _make_pre_hook(self, track: OptimizerTrack):
        def pre_hook(optimizer, args, kwargs):
            if not self.active:
                return None
            # args is (optimizer, *step_args): a closure is step's first positional argument or `closure=`.
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
            if closure is None:
                self._norm_queued = False  # a backward pass that raised never ran its callback: queue anew
            self._guard(self._before_step, track, closure is not None)
            if closure is None or not self.active:
                return None
            wrapped = self._wrap_closure(track, closure)
            if len(args) > 1:
                return (args[0], wrapped, *args[2:]), kwargs
            return args, dict(kwargs, closure=wrapped)
        return eager(pre_hook)

    def _before_step(self, track: OptimizerTrack, closure_step: bool) -> None:
        track.before_step(closure_step)
        track.note_grad_scaling()

    def _wrap_closure(self, track: OptimizerTrack, closure):
        """Closure-driven optimizers (LBFGS, and Lightning's automatic optimization) compute the gradient inside
        step(): capture the first evaluation's loss (at the parameters before the step) as the step's logged loss,
        and at recorded steps its gradient, its total norms and every evaluation's loss."""
        @eager
        def record_evaluation(loss):
            if self.active:
                self._guard(track.closure_evaluated, loss)

        def recording_closure(*args, **kwargs):
            loss = closure(*args, **kwargs)  # the user's closure: compiled if the step is
            record_evaluation(loss)
            return loss
        return recording_closure

    def _make_post_hook(self, track: OptimizerTrack):
        def post_hook(optimizer, args, kwargs):
            if self.active:
                self._guard(self._after_step, track)
            if self._job_scalars is not None:  # after every step, recording or not: the ranks join in step
                self._share_job_scalars(track)
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
        for track in self._tracks:
            track.pending = None
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

    def _after_step(self, track: OptimizerTrack) -> None:
        """The step's record (if any) to the file, or to the flight recorder's memory; the scalars that waited long
        enough without a record go on their own."""
        self._last_stepped = track
        logged, self._logged = self._logged, {}
        rec, selected = track.after_step(logged)
        if (rec is None or not (selected or rec.stats is not None)) and track.scalars_waiting() >= HOST_BATCH_STEPS:
            self._write_scalars(track)
        if rec is None:
            return
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
        check_logged(scalars)
        if not self.active or not scalars:
            return
        values = {name: kept(value) for name, value in scalars.items()}
        if not after_step or self._last_stepped is None:  # before any step: it can only belong to the first one
            self._logged.update(values)
        else:
            self._last_stepped.log_after_step(values)

    def _write_scalars(self, track: OptimizerTrack) -> None:
        """Write the optimizer's waiting scalar rows without a record."""
        rec = track.flush()
        if rec is not None:
            self._writer.write(rec)

    # -- a split job's live statistics ------------------------------------------------------------------------
    def _share_job_scalars(self, track: OptimizerTrack) -> None:
        """Join the statistics step's all-reduce (outside ``_guard``: a SIGTERM must still end a process waiting in
        it); rank 0 writes the result. JobScalars raises nothing; writing is a recorder error like any other."""
        parts, track.job_parts = track.job_parts, None
        combined = self._job_scalars.after_step(track.index, parts if self.active else None)
        if self._sinks is not None and self.active and (combined is not None or track.live_rows):
            self._guard(self._feed_job_step, track, combined)

    def _feed_job_step(self, track: OptimizerTrack, combined: tuple | None) -> None:
        """Hand rank 0's sinks the job's whole-parameter statistics of this step (when it had them) with the scalar
        rows read so far, on the writer thread."""
        rows, track.live_rows = track.live_rows, []
        steps = job_scalars.sink_steps(track.index, rows, combined)
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
        """Steps written so far, over all optimizers, at the ``every=`` and ``stats_every=`` cadences (with full tensors
        or statistics only; with a flight recorder, those chosen by ``every=``), plus the steps its dumps wrote."""
        return self._records + (self._flight.records_dumped if self._flight is not None else 0)

    @property
    def full_records(self) -> int:
        """Full-tensor records committed so far (what ``upd info`` counts as records, ``OptimizerRun.num_records``),
        flight-recorder dumps' steps included."""
        return self._full_records + (self._flight.records_dumped if self._flight is not None else 0)

    @property
    def dumps(self) -> list[dict]:
        """The flight recorder's dumps so far, one per trigger: optimizer, reason, trigger_step, steps written,
        wall_time (``Run.dumps()`` reads them from the file)."""
        return self._flight.dumps if self._flight is not None else []

    def close(self) -> None:
        """Remove every hook and close the file. Safe to call twice, and after recording stopped on an error.
        A recorder inherited through fork closes nothing: the file and its writer thread are the parent's."""
        if not lifetime.owned_here(self):
            self.active = False
            return
        was_active = self.active
        if was_active:
            for track in self._tracks:
                if track.scalar_rows:
                    self._guard(self._write_scalars, track)
            if self._job_scalars is not None and self._sinks is not None:
                for track in self._tracks:
                    if track.live_rows:
                        self._guard(self._feed_job_step, track, None)
            if self._alerts is not None and self.active:  # the last steps' alerts, dumps included, before the end
                self._guard(self._writer.sync)
                self._guard(self._act_on_alerts)
            was_active = self.active  # a write that failed stopped recording
        self.active = False
        self._remove_hooks()
        for track in self._tracks:
            track.pending = None
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

    def __repr__(self) -> str:
        state = "recording" if self.active else "closed"
        if self.rank_setup is not None and not self.rank_setup.records:
            state = f"not recording on rank {self.rank_setup.rank}"
        return (f"<upd.Recorder {self.path!r} {state}, {self.full_records} full-tensor records"
                + (f", {self._stats_steps} statistics steps" if self.stats_every is not None else "") + ">")




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
        {options}

    The returned ``Recorder`` also stores per-step scalars: ``rec.log(loss=loss)`` (see ``Recorder.log``), and
    logs, at each recorded step, the total gradient norm as the backward pass left it and as the step saw it
    (clipping shows as the second smaller: ``upd info`` says on how many steps).
    """
    return Recorder(path, model, optimizer, **options)


# help(upd.record), inspect and notebooks show every option with its default and its entry, from RecordOptions.
if record.__doc__:  # python -OO drops docstrings
    record.__doc__ = record.__doc__.replace("        {options}", documented_options(indent=8))
_LEADING = [inspect.Parameter("path", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
              for name in ("model", "optimizer"))]
record.__signature__ = record_signature(*_LEADING)
Recorder.__init__.__signature__ = record_signature(inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                                   *_LEADING)
