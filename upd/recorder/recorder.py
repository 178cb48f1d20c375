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
import os
import warnings

import torch

from .. import lifetime
from ..runfile import schema
from ..runfile.async_writer import AsyncRunWriter
from . import distributed
from .attaching import attach
from .backward import BackwardCounts, eager
from .cadence import size_warning
from .flight_recorder import FlightRecorder
from .grad_norms import queue_after_backward
from .live import ALERTS_NOT_IN_SPLIT_JOB, LiveOutputs, check_sinks, live_role, recorded_stats_every
from .logged_scalars import HOST_BATCH_STEPS, check_logged, kept
from .naming import patterns, unmatched_patterns
from .options import RecordOptions
from .record_help import document
from .recording_setup import (TrackedOptimizers, held_by_another_recorder, refuse_directory, remove_quietly,
                              track_settings, tracked_optimizers)
from .resume import continue_tracks
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
        check_sinks(opts.sinks)  # TypeError, like an option that does not exist

        # An inactive recorder from here on: everything below that cannot record returns it as it is (one
        # RecorderWarning, no hooks, no file), so that setup never breaks the training either.
        self.path = os.fspath(path)
        self.options = opts
        self.rank_setup = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.every, self.flight_recorder = opts.every, opts.flight_recorder
        self.stats_every = recorded_stats_every(opts)  # live values come from the statistics: 1 unless given
        self.strict = opts.strict
        self.include, self.exclude = patterns(opts.include), patterns(opts.exclude)
        self.active = False
        self.error: BaseException | None = None
        self._flight: FlightRecorder | None = None  # made with the writer it dumps to
        self._live = LiveOutputs(opts)  # the sinks, the live alerts, a split job's shared statistics
        self._handles = []
        self._tracks: list[OptimizerTrack] = []  # one per optimizer, in the run's order
        self._backward = BackwardCounts(self._backward_counted, self._handles)
        self._records = 0  # steps written at the cadences (the flight recorder counts its dumps)
        self._full_records = 0  # of those, full-tensor records
        self._stats_steps = 0  # steps whose statistics were written
        self._logged: dict[str, object] = {}  # rec.log() values waiting for the next optimizer step
        self._last_stepped: OptimizerTrack | None = None  # completed a step last (rec.log(after_step=True))
        self._norm_queued = False  # a callback at the end of the backward pass in progress is queued

        refuse_directory(self.path)
        try:
            attached = attach(self.path, model, optimizer, opts.ranks)  # looked through every wrapper
        except TypeError as exc:
            self._cannot_record(exc)
            return
        self.rank_setup = attached.rank_setup
        recording_here = self.rank_setup is None or self.rank_setup.records
        if recording_here and self.rank_setup:
            self.path = self.rank_setup.file
        held = held_by_another_recorder(self.path) if recording_here else None
        if held is not None:
            self._cannot_record(held)
            return
        self.optimizers = attached.optimizers
        role = live_role(opts, self.rank_setup)  # ValueError for live sinks a split job cannot feed
        settings = track_settings(opts, self.stats_every, self.include, self.exclude, self.rank_setup, role)
        try:
            tracked = tracked_optimizers(attached, settings, self._backward)
        except Exception as exc:
            self._cannot_record(exc)
            return
        self._tracks = tracked.tracks
        unmatched = unmatched_patterns(tracked.param_names(), self.include, self.exclude)
        if unmatched:
            warnings.warn(f"torch-upd: {unmatched}: {self.path} will hold no parameter. Check the patterns (glob, on "
                          "these names).", RecorderWarning, stacklevel=3)
        too_large = recording_here and size_warning(sum(t.full_record_bytes for t in self._tracks), opts.every)
        if too_large:
            warnings.warn(f"torch-upd: {self.path}: {too_large}", RecorderWarning, stacklevel=3)

        self._live.wire(opts, role, self.rank_setup, self.stats_every, self._tracks, self._warn_sink,
                        self._warn_job_scalars)
        if role.alerts_unchecked:
            warnings.warn(ALERTS_NOT_IN_SPLIT_JOB, RecorderWarning, stacklevel=3)
        if recording_here:  # else another rank records: no file, no hooks, nothing to close
            self._start_writing(tracked, settings)

    def _start_writing(self, tracked: TrackedOptimizers, settings: TrackSettings) -> None:
        """Create the run file and hook the optimizers: the recorder is active when this returns, unless it warned
        (called by __init__: its warnings point at the user's upd.record line, stacklevel 5)."""
        opts = self.options
        meta = run_meta(opts.stored(stats_every=settings.stats_every, stats_sample=settings.stats_sample,
                                    include=self.include, exclude=self.exclude), len(self.optimizers), self.rank_setup)
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
            self._writer = AsyncRunWriter(self.path, meta, overwrite=opts.overwrite, storage_dtype=opts.dtype,
                                          compression=opts.compression, resume=opts.resume, max_pending=2,
                                          before_full_write=wait_for_copies, **self._live.writer_hooks())
        except FileExistsError:
            # Refusing to overwrite is the answer the user asked for (overwrite= defaults to False to protect an
            # earlier run): raised, before the first step, like a bad option value.
            raise
        except Exception as exc:  # permission denied, read-only or full filesystem: never stop the training
            if not existed:
                remove_quietly(self.path)
            self._cannot_record(exc, stacklevel=5)
            if self._live.job_scalars is not None:  # the other ranks all-reduce with this one: keep joining
                for track in self._tracks:
                    self._handles.append(track.optimizer.register_step_post_hook(self._make_post_hook(track)))
            return
        if self._live.alerts is not None:
            self._live.alerts.store = self._writer.events_writer()
        if opts.flight_recorder is not None:
            self._flight = FlightRecorder(self._writer, len(self.optimizers), opts.flight_recorder, opts.spike_factor)
        try:
            if opts.resume:
                # stacklevel 6: the user's upd.record line (continue_tracks, here, __init__, record, then it)
                continue_tracks(self._writer, self.path, self._tracks, tracked.metas,
                                lambda text: warnings.warn(text, RecorderWarning, stacklevel=6))
        except BaseException:
            self._discard_writer(ours)
            raise  # a run that cannot be continued: the user's mistake, like an existing file without overwrite=
        try:
            for track, opt_meta in zip(self._tracks, tracked.metas):
                self._writer.add_optimizer(track.index, opt_meta)
                self._handles.append(track.optimizer.register_step_pre_hook(self._make_pre_hook(track)))
                self._handles.append(track.optimizer.register_step_post_hook(self._make_post_hook(track)))
            for opt in self.optimizers:
                # Count from the very first backward pass: before the first step, accumulation and skipped steps
                # would otherwise be invisible.
                for group in opt.param_groups:
                    for p in group["params"]:
                        self._backward.hook(p)
            if tracked.not_optimized is not None:
                self._writer.set_attr(schema.ATTR_PARAMS_NOT_OPTIMIZED, tracked.not_optimized)
        except Exception as exc:
            self._discard_writer(ours)
            self._cannot_record(exc, stacklevel=5)
            return
        except BaseException:
            self._discard_writer(ours)
            raise
        self.active = True
        lifetime.recorders.add(self)

    def _cannot_record(self, exc: Exception, stacklevel: int = 4) -> None:
        """Setup found something it cannot record: the recorder stays inactive, with one warning (the exception
        itself with strict=True; called inside the ``except`` that caught it). `stacklevel` reaches the user's
        upd.record line from here: 4 when called by __init__."""
        self._remove_hooks()
        self.error = exc
        if self.strict:
            raise exc
        warnings.warn(f"torch-upd: cannot record to {self.path} ({type(exc).__name__}: {exc}); training "
                      "continues without recording. Pass strict=True to raise instead.", RecorderWarning,
                      stacklevel=stacklevel)

    def _discard_writer(self, ours: bool) -> None:
        """Undo a setup that created the writer and then failed: no hooks, the file closed, and removed when it is
        this recorder's own."""
        self._remove_hooks()
        self._writer.abort()
        self._flight = None
        if ours:
            remove_quietly(self.path)

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
            if self._live.job_scalars is not None:  # after every step, recording or not: the ranks join in step
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
        if self._live.alerts is not None:
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
        combined = self._live.job_scalars.after_step(track.index, parts if self.active else None)
        if self._live.feed is not None and self.active and (combined is not None or track.live_rows):
            self._guard(self._live.feed_job_step, self._writer, track, combined)

    def _warn_job_scalars(self, why: str) -> None:
        warnings.warn(f"torch-upd: the job's live statistics stop: {why}; training continues.",
                      RecorderWarning, stacklevel=2)

    def _act_on_alerts(self, closing: bool = False) -> None:
        """On the training thread: the alerts the writer thread found since the last step warned about, and the
        flight recorder's dump they asked for done (upd.recorder.alerts)."""
        texts, reason = self._live.alerts.take()
        for text in texts:
            warnings.warn(text, TrainingAlert, stacklevel=4)
        if reason is not None and self._flight is not None and not closing:
            self._flight.dump(reason)
        if closing and self._live.alerts.closing_text():
            warnings.warn(self._live.alerts.closing_text(), TrainingAlert, stacklevel=3)

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
            if self._live.job_scalars is not None and self._live.feed is not None:
                for track in self._tracks:
                    if track.live_rows:
                        self._guard(self._live.feed_job_step, self._writer, track, None)
            if self._live.alerts is not None and self.active:
                # the last steps' alerts, dumps included, before the end
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
                self._live.close(self._warn_sink)
                if self._live.alerts is not None:  # the last records' alerts, checked as the writer drained
                    self._act_on_alerts(closing=True)
        else:
            self._live.close(self._warn_sink)

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


def record(path, model=None, optimizer=None, **options) -> Recorder:
    """Record what ``optimizer.step()`` does, to one HDF5 file, without changing the training loop."""
    return Recorder(path, model, optimizer, **options)


# help(upd.record), inspect and notebooks show every option with its default and its entry, from RecordOptions; the
# full docstring, with every argument's entry, is record_help.RECORD_DOC.
document(record, Recorder)
