"""One optimizer the recorder watches (``OptimizerTrack``): everything kept for it between and during its steps.

The ``Recorder`` owns the hooks, the never-break-training guard, the writer and the sinks; each of its optimizers
has one track that owns the rest: its step count, its parameters' names and layout, the lean statistics' plan and
buffers, the step in progress (from the pre-step to the post-step hook), the scalars waiting for the host and the
total gradient norm of the last backward pass. The recorder calls a track at four points: ``before_step``,
``closure_evaluated`` (step(closure) only), ``after_step`` (which hands back the step's ``Record`` for the writer)
and ``flush`` (the scalar rows still waiting). Nothing here writes: the recorder decides where a record goes (the
file, or the flight recorder's memory).
"""
from __future__ import annotations

import dataclasses
import operator
import time

import torch

from ..runfile import encoding, schema
from ..runfile.record import ParamSnapshot, Record, ShardLayout, param_meta
from . import distributed
from .backward import BackwardCounts
from .cadence import full_record_bytes, full_record_cadence, is_full_step, state_tensors
from .device_stats import LeanStep, SnapshotPool, StepStatistics, element_count, lean_applies
from .engines import LEAN, SAMPLED, StatisticsEngine, statistics_set
from .grad_norms import MEASURED_UNCHANGED, SAME_AS_STEP, BackwardNorm, total_norm
from .grad_scaling import GradScaling
from .job_scalars import Slot
from .logged_scalars import HOST_BATCH_STEPS, scalar_problem, to_host
from .naming import ParamNames, is_selected
from .partition_view import PartitionView
from .sampled_stats import SampledPool, SampledStep
from .snapshots import (HparamsSnapshots, cpu_copy, dtensor_class, local_part, refuse_unlike_param,
                        shard_layout, state_snapshot)


@dataclasses.dataclass(frozen=True)
class TrackSettings:
    """What every track of one recorder records: the options as the recorder records with them, and the roles the
    recorder decided (a flight recorder, live sinks, a split job's shared statistics)."""

    every: int | None
    stats_every: int | None
    full_stats_every: int | None
    stats_sample: int | None  # None in a distributed job (a job's statistics are its local parts' exact ones)
    what: tuple
    zero_counts: tuple
    include: list
    exclude: list
    rank_setup: object  # distributed.RankSetup, None in a single process
    keeps_every_step: bool  # a flight recorder: every step's full tensors are kept in memory
    feeds_sinks: bool  # this process feeds live sinks: a statistics step reads its scalars with it
    shares_job_statistics: bool  # a split job's live statistics: the parts' statistics are all-reduced after a step
    dtype: str = "keep"  # the full records' storage dtype (dtype=): what a full record of every= AUTO weighs


@dataclasses.dataclass
class TrackedParam:
    """One selected parameter during a step."""

    live: torch.Tensor  # the parameter itself
    snapshot: ParamSnapshot  # its name and place; at a full step also the CPU copies the record stores
    before: torch.Tensor | None = None  # statistics-only step: its value before the step, kept on its device


@dataclasses.dataclass
class StepInProgress:
    """What a track holds between the pre- and the post-step hook; only `record` goes to the writer."""

    record: Record
    params: list[TrackedParam]
    selected: bool  # chosen by every= (with a flight recorder, full snapshots are kept for other steps too)
    closure: bool  # step(closure): the gradient exists only inside the step
    stats: StatisticsEngine | None  # a statistics step: some launched before the step, the rest after it
    stats_meta: dict | None = None  # the statistics' parameter metadata, when known before the step (LeanPlan)
    norm_from_stats: bool = False  # the step's total gradient norm is the statistics' (``grad_norm``, after the step)


@dataclasses.dataclass
class LeanPlan:
    """What a lean statistics step needs that changes only with the optimizer's parameters: made once per parameter
    layout, so that such a step walks no parameter in Python (naming, selecting, metadata) to start."""

    layout: tuple  # the OptimizerTrack.layout it was made for (compared by identity)
    tracked: list[TrackedParam]  # the selected parameters, in the optimizer's order (never modified by a step)
    live: list[torch.Tensor]
    names: list[str]
    all_selected: bool  # every parameter of the optimizer is selected: the lean gradient norms are all of them
    stats_meta: dict  # name -> param_meta


_PLAIN_TENSOR = {torch.Tensor}
_STRIDED = {torch.strided}
# per-step attribute reads over every parameter, done by map in C rather than a Python loop
_GRAD, _LAYOUT = operator.attrgetter("grad"), operator.attrgetter("layout")
_NONE_ID = id(None)


def gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's gradients (of a DTensor, the local part: the whole of it when one process holds it all)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return grads if dtensor_class() is None else [local_part(g) for g in grads]


def layout_of(optimizer) -> tuple:
    """The optimizer's parameters by identity: names and hooks change only when this does (add_param_group, a
    swapped tensor), and a tuple of ids is far cheaper than naming every parameter again at every step."""
    groups = optimizer.param_groups
    if len(groups) == 1:
        return tuple(map(id, groups[0]["params"]))
    return tuple(id(p) for group in groups for p in group["params"])


class OptimizerTrack:
    """One optimizer of a recorder: `index` in the run, `optimizer` the one whose hooks fire (a ZeRO rank's local
    optimizer), `job_optimizer` the one the user built (holding every rank's parameters), `steps_done` its steps
    so far (the next step's number)."""

    def __init__(self, index: int, optimizer, job_optimizer, names: ParamNames, steps_done: int,
                 settings: TrackSettings, backward: BackwardCounts):
        self.index = index
        self.optimizer = optimizer
        self.job_optimizer = job_optimizer
        self.names = names
        self.steps_done = steps_done
        self.settings = settings
        self.backward = backward
        self.layout: tuple | None = None  # layout_of(optimizer) when names were last assigned
        self.pending: StepInProgress | None = None
        self.scalar_rows: list = []  # [(step, wall_time, {name: value})] not yet written
        self.live_rows: list = []  # a split job's rank 0: scalar rows on the host, for the sinks
        self.job_parts: tuple[int, dict] | None = None  # (step, its parts' statistics), until shared
        self._step_scalars: dict = {}  # scalars the recorder measured in the step in progress
        self.grad_scaling: GradScaling | None = None  # what GradScaler handed the fused step in progress
        self._backward_norms = BackwardNorm()  # the total norm at each backward pass's end, while it can differ
        self._backward_relation: str | None = None  # what the step in progress took from it (BackwardNorm.at_step)
        self._closure_evaluated_once = False  # this step(closure) evaluated its closure
        self._shards: dict[int, ShardLayout] = {}  # id(DTensor parameter) -> its ShardLayout, found with its name
        self.stats_pool: SnapshotPool | None = None  # the lean statistics' snapshot buffers
        self.sampled_pool: SampledPool | None = None  # the same, for statistics from samples (stats_sample)
        self._lean_plan: LeanPlan | None = None  # its lean steps' plan for the current layout
        self._hparams = HparamsSnapshots()  # each recorded step's hyperparameters
        self._no_lean_plan_for: tuple | None = None  # a layout the lean set does not take (``_make_lean_plan``)
        self._job_slots: tuple[tuple, list[Slot]] | None = None  # (the job optimizer's layout, its slots)
        # what one full record of this optimizer stores, from its parameters now; every= as its steps take it (AUTO:
        # from that size)
        self.full_record_bytes = self._full_record_bytes()
        self.full_every, self.first_full_steps = full_record_cadence(settings.every, self.full_record_bytes)

    def cadence(self, step: int) -> tuple[bool, bool]:
        """(a full record by every=, a statistics step) for an optimizer step."""
        stats_every = self.settings.stats_every
        return (is_full_step(step, self.full_every, self.first_full_steps),
                stats_every is not None and step % stats_every == 0)

    def _full_record_bytes(self) -> int:
        """What one full record of this optimizer stores (``cadence.full_record_bytes``): every= AUTO picks its
        cadence from it, and an explicit every= warns when it would fill the disk."""
        what, settings = self.settings.what, self.settings
        param_bytes = sum(p.numel() * encoding.storage_numpy_dtype(p.dtype, settings.dtype)[0].itemsize
                          for g, group in enumerate(self.optimizer.param_groups)
                          for i, p in enumerate(group["params"])
                          if is_selected(self.names.name(p, g, i, group), settings.include, settings.exclude))
        kinds = 2 * ("param" in what) + ("grad" in what)  # before and after the step, the gradient
        state = state_tensors(type(self.optimizer).__name__) if "state" in what else 0
        return full_record_bytes(param_bytes, state, kinds)

    # -- the run's metadata -------------------------------------------------------------------------------------
    def meta(self) -> dict:
        """The optimizer's entry in the run's metadata."""
        opt = self.optimizer
        return {
            "class": encoding.class_path(type(opt)),
            "mro": [encoding.defining_path(c) for c in type(opt).__mro__ if issubclass(c, torch.optim.Optimizer)],
            "defaults": encoding.jsonable({k: v for k, v in opt.defaults.items() if k != "params"}),
            "initial_step": self.steps_done,
            "params": self.param_layout(),
            # the steps with full records, as every= resolved for this optimizer (AUTO: by its records' size)
            "full_records": {"every": self.full_every, "first_steps": self.first_full_steps},
        }

    def param_layout(self) -> list:
        """Name, shape and group of every parameter the optimizer holds now (resume compares against it)."""
        # requires_grad=False: a frozen parameter the optimizer holds; it gets no gradient, hence no rows, and
        # readers list it as frozen rather than let it vanish.
        return [{"name": self.names.name(p, g, i, group), "shape": list(p.shape), "group": g,
                 **({} if p.requires_grad else {"requires_grad": False})}
                for g, group in enumerate(self.optimizer.param_groups) for i, p in enumerate(group["params"])]

    # -- total gradient norms -----------------------------------------------------------------------------------
    def backward_ended(self) -> None:
        """The end of a backward pass: the total gradient norm, when the next step is recorded, before anything
        between backward and step can change it."""
        if any(self.cadence(self.steps_done)):
            plan = self._lean_plan  # its parameters are the optimizer's, in order: no walk over its groups
            if plan is not None and plan.all_selected and plan.layout == layout_of(self.optimizer):
                grads = list(map(_GRAD, plan.live))
                if _NONE_ID in map(id, grads):
                    grads = [g for g in grads if g is not None]
            else:
                grads = gradients(self.optimizer)
            self._backward_norms.ended(grads)

    def _measure_step_norms(self) -> None:
        """The total gradient norm as the step sees it, next to the one the last backward pass left (a clipped step
        shows as the first smaller than the second); launched on the device, read with the step's scalars."""
        if self.settings.rank_setup is not None:
            return  # a rank's gradients are a part, or not yet reduced when its backward pass ends
        if not any(self.cadence(self.steps_done)):
            self._backward_norms.forget()
            return  # a step the flight recorder keeps in memory only: it writes nothing while training is healthy
        grads = gradients(self.optimizer)
        self._take_backward_norm(grads)
        seen = total_norm(grads)
        if seen is not None:
            self._step_scalars[schema.SCALAR_GRAD_NORM_AT_STEP] = seen

    def _take_backward_norm(self, grads: list[torch.Tensor]) -> None:
        """The backward pass's norm into the step's scalars where it was measured; what the post-step does about it
        (``_settle_backward_norm``) where it was not, or is to be compared."""
        backward, self._backward_relation = self._backward_norms.at_step(grads)
        if backward is not None:
            self._step_scalars[schema.SCALAR_GRAD_NORM_BACKWARD] = backward

    def _settle_backward_norm(self) -> None:
        """After the step, its norm known: the backward pass's is the same where the gradients did not change in
        between; where both were measured over unchanged gradients, they are compared (BackwardNorm.compared)."""
        relation, self._backward_relation = self._backward_relation, None
        scalars = self._step_scalars
        step = scalars.get(schema.SCALAR_GRAD_NORM_AT_STEP)
        if relation is None or step is None:
            return
        if relation == SAME_AS_STEP:
            scalars[schema.SCALAR_GRAD_NORM_BACKWARD] = step
        elif relation == MEASURED_UNCHANGED and schema.SCALAR_GRAD_NORM_BACKWARD in scalars:
            self._backward_norms.compared(float(scalars[schema.SCALAR_GRAD_NORM_BACKWARD]), float(step))

    # -- one step -----------------------------------------------------------------------------------------------
    def before_step(self, closure_step: bool) -> None:
        """The pre-step hook's work: the step's record started, its statistics launched (nothing at a step that
        records nothing)."""
        self._step_scalars = {}
        self._backward_relation = None
        self._closure_evaluated_once = False
        self.pending = None  # a step that raised never reached its post-hook
        optimizer, names, settings = self.optimizer, self.names, self.settings
        step = self.steps_done
        layout = layout_of(optimizer)
        dtensor = dtensor_class()
        if self.layout != layout:
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    name = names.name(p, g, i, group)
                    layout_of_part = shard_layout(p, f"parameter {name}")
                    if layout_of_part is not None:
                        self._shards[id(p)] = layout_of_part
                    self.backward.hook(p)
            self.layout = layout
        selected = self.cadence(step)[0]
        full = selected or settings.keeps_every_step  # the flight recorder keeps every step in memory
        engine = statistics_set(step, stats_every=settings.stats_every, full_stats_every=settings.full_stats_every,
                                full_record=full, stats_sample=settings.stats_sample)
        with_stats, lean = engine is not None, engine in (LEAN, SAMPLED)
        if not (full or with_stats):
            self._backward_norms.forget()
            return
        if lean and self._start_lean_step(step, closure_step, engine == SAMPLED):
            return
        if not closure_step:  # a closure's gradient exists only inside step(): measured at its first evaluation
            self._measure_step_norms()
        what, include, exclude = settings.what, settings.include, settings.exclude
        params = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = names[p]
                # The optimizer skips a parameter without a gradient, so there is nothing to record for it; with a
                # closure the gradient appears only inside step(), so that is decided after the step.
                if (p.grad is None and not closure_step) or not is_selected(name, include, exclude):
                    continue
                # DTensor gradients and state are stored as the parameter's part. Checked when the parameter or its
                # gradient is one (optimizer state is made like the parameter): not per tensor of every model.
                if dtensor is not None and (isinstance(p, dtensor) or isinstance(p.grad, dtensor)):
                    refuse_unlike_param(p.grad, p, f"the gradient of {name}")
                    for key, value in optimizer.state.get(p, {}).items():
                        refuse_unlike_param(value, p, f"optimizer state {key!r} of {name}")
                tracked = TrackedParam(live=p, snapshot=ParamSnapshot(name=name, group=g, index_in_group=i,
                                                                      shard=self._shards.get(id(p))))
                if full:
                    snap = tracked.snapshot
                    if "param" in what:
                        snap.param = cpu_copy(p)
                    if "grad" in what and not closure_step:
                        snap.grad = cpu_copy(p.grad)
                    if "state" in what:
                        snap.state = state_snapshot(optimizer.state.get(p, {}))
                elif not lean:
                    # Statistics only: the one snapshot the update needs, kept on the parameter's device and freed
                    # after the step (the lean set copies into buffers it keeps instead).
                    tracked.before = local_part(p.detach()).clone()
                params.append(tracked)
        backward = self.backward.passes(self.layout)
        stats = self._lean_statistics(params) if lean else None
        if with_stats and stats is None:
            stats = StepStatistics(settings.zero_counts)
            if not full:
                self._launch_stats_before_step(stats, params, closure_step)
        record = Record(optimizer=self.index, step=step, backward_pass=backward, wall_time=time.time(),
                        hparams=self._hparams(optimizer.param_groups),
                        params=[t.snapshot for t in params] if full else [],
                        closure_losses=[] if closure_step else None, full=full)
        self.pending = StepInProgress(record=record, params=params, selected=selected, closure=closure_step,
                                      stats=stats)

    def _start_lean_step(self, step: int, closure_step: bool, sampled: bool) -> bool:
        """A lean statistics step of a single-process run, started from the layout's LeanPlan: the statistics' copies
        taken before the step, and the total gradient norm as the step sees it taken after it from their sums of
        squares (no pass of its own). False, having done nothing, where the general path must take the step: DTensors,
        tensors the lean set does not take (lean_applies), no parameter with a gradient. A step(closure) has no
        gradient yet: the parameters are copied now and the gradients reduced after the step (LeanStep with
        grads=None, exact statistics whatever stats_sample says), and the step's total norm is taken when the
        closure is first evaluated, as on the general path."""
        if self.settings.rank_setup is not None:
            return False
        plan = self._lean_plan
        if plan is None or plan.layout is not self.layout:
            if self._no_lean_plan_for is self.layout:
                return False
            plan = self._make_lean_plan()
            if plan is None:
                self._no_lean_plan_for = self.layout  # until the parameters change
                return False
            self._lean_plan = plan
        tracked, live, names, stats_meta = plan.tracked, plan.live, plan.names, plan.stats_meta
        if closure_step:
            stats = LeanStep(self._snapshot_pool(), names, live, live, None)
        else:
            grads = list(map(_GRAD, live))
            # The parameters were checked with the plan (lean_applies); autograd gives a gradient its parameter's
            # shape, dtype and device, but a sparse one (nn.Embedding(sparse=True)) and a DTensor one of a plain
            # parameter are the general path's (which refuses the latter by name). One pass where every gradient is
            # a plain dense tensor: no None, no subclass.
            if set(map(type, grads)) != _PLAIN_TENSOR or set(map(_LAYOUT, grads)) != _STRIDED:
                if any(g is None for g in grads):  # skipped by the optimizer (a frozen parameter): not recorded
                    tracked = [t for t, g in zip(tracked, grads) if g is not None]
                    live, names = [t.live for t in tracked], [t.snapshot.name for t in tracked]
                    stats_meta = {name: stats_meta[name] for name in names}
                    grads = [g for g in grads if g is not None]
                if not grads or not all(g.layout is torch.strided for g in grads):
                    return False
                dtensor = dtensor_class()
                if dtensor is not None and any(isinstance(g, dtensor) for g in grads):
                    return False
            if sampled:  # single-process runs only: a DTensor's local parts get the exact set
                if self.sampled_pool is None:
                    self.sampled_pool = SampledPool(self.settings.stats_sample)
                stats = SampledStep(self.sampled_pool, names, live, grads)
            else:
                stats = LeanStep(self._snapshot_pool(), names, live, live, grads)
            if plan.all_selected:  # the statistics' own per-gradient norms give the step's norm, after the step
                self._take_backward_norm(grads)
            else:
                every_grad = gradients(self.optimizer)
                self._take_backward_norm(every_grad)
                self._step_scalars[schema.SCALAR_GRAD_NORM_AT_STEP] = total_norm(every_grad)
        record = Record(optimizer=self.index, step=step, backward_pass=self.backward.passes(self.layout),
                        wall_time=time.time(), hparams=self._hparams(self.optimizer.param_groups),
                        params=[], closure_losses=[] if closure_step else None, full=False)
        self.pending = StepInProgress(record=record, params=tracked, selected=False, closure=closure_step,
                                      stats=stats, stats_meta=stats_meta,
                                      norm_from_stats=plan.all_selected and not closure_step)
        return True

    def _snapshot_pool(self) -> SnapshotPool:
        if self.stats_pool is None:
            self.stats_pool = SnapshotPool()
        return self.stats_pool

    def _make_lean_plan(self) -> LeanPlan | None:
        """The selected parameters of this layout, named, with their metadata; None when one is a DTensor or the lean
        set does not take one (``lean_applies``)."""
        dtensor = dtensor_class()
        tracked, all_selected = [], True
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = self.names[p]
                if not is_selected(name, self.settings.include, self.settings.exclude):
                    all_selected = False
                    continue
                if dtensor is not None and isinstance(p, dtensor):
                    return None
                tracked.append(TrackedParam(live=p, snapshot=ParamSnapshot(name=name, group=g, index_in_group=i)))
        live = [t.live for t in tracked]
        if not lean_applies(live, live):  # the parameters' side; their gradients are checked at each step
            return None
        return LeanPlan(layout=self.layout, tracked=tracked, live=live,
                        names=[t.snapshot.name for t in tracked], all_selected=all_selected,
                        stats_meta={t.snapshot.name: param_meta(t.snapshot, t.live) for t in tracked})

    def _launch_stats_before_step(self, stats: StepStatistics, params: list[TrackedParam], closure_step: bool) -> None:
        """Gradient and state statistics of a statistics-only step must see the values before the step (the state is
        updated in place): launched now for all parameters at once, read after the step with everything else. The
        parameters' own (their snapshots before the step) go in the same batch: one batched call fewer than after
        the step, and their keys last, so the table's columns keep their order (StepStatistics.after_step)."""
        optimizer = self.optimizer
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
        for tracked in params:
            keys.append((tracked.snapshot.name, "param"))
            tensors.append(tracked.before)
        by_name = {tracked.snapshot.name: tracked for tracked in params}

        def after_the_step():
            # A NaN/Inf recount reads the tensor again: the gradient and the snapshot are still there; the state has
            # been updated in place by the step, so its count is of the state after the step.
            return [by_name[name].before if kind == "param" else
                    local_part(by_name[name].live.grad if kind == "grad" else
                               optimizer.state.get(by_name[name].live, {}).get(kind[len("state."):]))
                    for name, kind in keys]
        stats.launch(keys, tensors, recount=after_the_step)

    def _lean_statistics(self, params: list[TrackedParam]) -> LeanStep | None:
        """The lean set launched before the step (device_stats.LeanStep); None where it does not apply, after taking
        the snapshots the full set's path needs instead."""
        live = [t.live for t in params]
        parts = [local_part(p.detach()) for p in live]
        grads = [local_part(p.grad) for p in live]
        if lean_applies(parts, grads):
            return LeanStep(self._snapshot_pool(), [t.snapshot.name for t in params], live, parts, grads)
        for tracked, part in zip(params, parts):
            tracked.before = part.clone()
        return None

    def closure_evaluated(self, loss) -> None:
        """step(closure) evaluated its closure: the first evaluation's loss is the step's, and at a recorded step
        its gradient (the step's), its total norms and every evaluation's loss go into the record."""
        first = not self._closure_evaluated_once
        self._closure_evaluated_once = True
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        if first and value is not None and scalar_problem(value) is None:
            self._step_scalars[schema.SCALAR_LOSS] = value  # read with the step's other scalars: no synchronisation
        pending = self.pending
        if pending is None:
            return
        if first:
            self._measure_step_norms()
        pending.record.closure_losses.append(float(value) if value is not None else float("nan"))
        if first:
            # The step's gradient is the first evaluation's, and its backward pass ran inside step(), after the
            # pre-hook counted: counted again here, or every step(closure) (Lightning's automatic optimization
            # steps so) would read one backward pass short.
            pending.record.backward_pass = self.backward.passes(self.layout)
        if first and "grad" in self.settings.what and pending.record.full:
            for tracked in pending.params:
                if tracked.live.grad is not None:
                    tracked.snapshot.grad = cpu_copy(tracked.live.grad)

    def note_grad_scaling(self) -> None:
        """What GradScaler handed this fused step (``grad_scaling``), kept for after_step; its scale and found_inf
        join the step's scalars (at every such step, recorded or not: a flight recorder's dump must verify)."""
        self.grad_scaling = GradScaling.of(self.optimizer)
        if self.grad_scaling is not None:
            self.grad_scaling.add_scalars(self._step_scalars)

    def after_step(self, logged: dict) -> tuple[Record | None, bool]:
        """The post-step hook's work: (the step's record, selected by every=), or (None, False) at a step that
        records nothing. `logged`: the values ``rec.log`` gave this step. The step's waiting scalars go with its
        record when it is read to the host anyway (a full record; a statistics step that feeds sinks); the caller
        writes the rest once ``scalars_waiting()`` reaches HOST_BATCH_STEPS (``flush``)."""
        step = self.steps_done
        self.steps_done += 1
        pending, self.pending = self.pending, None
        scaling, self.grad_scaling = self.grad_scaling, None
        if pending is None:
            self._queue_scalars(step, time.time(), logged)
            return None, False
        rec, settings = pending.record, self.settings
        if pending.closure and "grad" in settings.what and rec.full:
            # Parameters the closure gave no gradient were skipped by the optimizer, as in a plain step.
            pending.params = [t for t in pending.params if t.snapshot.grad is not None]
            rec.params = [t.snapshot for t in pending.params]
        if pending.stats is not None:
            rec.stats = pending.stats.after_step(pending)  # one device-to-host copy, whichever engine
            if pending.norm_from_stats:  # of the gradients as they came: unscaled as the step used them
                norm = pending.stats.grad_norm  # a float: from the statistics' host copy
                if scaling is not None and scaling.grad_scale is not None:
                    norm = norm / scaling.scale_on_host()
                self._step_scalars[schema.SCALAR_GRAD_NORM_AT_STEP] = norm
        self._settle_backward_norm()
        self._queue_scalars(step, rec.wall_time, logged)
        if pending.stats is not None:
            if scaling is not None:  # the gradients as the fused step used them (a job's parts included)
                rec.stats = scaling.unscaled(rec.stats)
            rec.stats_meta = pending.stats_meta if pending.stats_meta is not None else {
                t.snapshot.name: param_meta(t.snapshot, local_part(t.live)) for t in pending.params}
            if settings.shares_job_statistics:
                self.job_parts = (rec.step, {
                    t.snapshot.name: (element_count(local_part(t.live)), rec.stats[t.snapshot.name])
                    for t in pending.params
                    if t.snapshot.name in rec.stats and distributed.counts_toward_whole(t.live, settings.rank_setup)})
        if rec.full and scaling is not None:
            scaling.unscale_grads(rec.params)
        if rec.full:
            for t in pending.params:
                t.snapshot.param_after = cpu_copy(t.live) if "param" in settings.what else None
        selected = pending.selected
        del pending  # statistics only: the device snapshots are released now, before the writer may block
        if selected:  # a full record is written now, its tensors copied to the host: the scalars go with it
            rec.scalars = self.scalars_on_host()
        elif rec.stats is not None and (settings.feeds_sinks or self.scalars_waiting() >= HOST_BATCH_STEPS):
            # The sinks get a step's statistics and its scalars together: read now, the device is idle by now. Else
            # a statistics step read its one host copy already: the scalars wait for a full record, or until
            # HOST_BATCH_STEPS steps wait (one more copy per that many steps, of a device that is idle by now).
            rec.scalars = self.scalars_on_host()
        return rec, selected

    # -- logged scalars -----------------------------------------------------------------------------------------
    def _queue_scalars(self, step: int, wall_time: float, logged: dict) -> None:
        """The values logged for this step, and those the recorder measured in it, wait for the host copy."""
        values, self._step_scalars = self._step_scalars, {}
        values.update(logged)  # rec.log(loss=...) wins over the closure's loss
        if values:
            self.scalar_rows.append((step, wall_time, values))

    def log_after_step(self, values: dict) -> None:
        """``rec.log(after_step=True)``: values of the step completed last."""
        step, rows = self.steps_done - 1, self.scalar_rows
        if rows and rows[-1][0] == step:
            rows[-1][2].update(values)
        else:  # the step's row was written already (or it logged nothing): a second row, merged by readers
            rows.append((step, time.time(), values))

    def scalars_waiting(self) -> int:
        return len(self.scalar_rows)

    def scalars_on_host(self) -> list:
        """The waiting scalar rows read to the host (one copy per device). A split job's rank 0 keeps them for its
        sinks too, which get them with the job's statistics (the file's records carry rank 0's part)."""
        rows, self.scalar_rows = self.scalar_rows, []
        if not rows:
            return []
        rows = to_host(rows)
        if self.settings.feeds_sinks and self.settings.shares_job_statistics:
            self.live_rows.extend(rows)
        return rows

    def flush(self) -> Record | None:
        """The waiting scalar rows as a record of their own (no step's tensors or statistics), or None."""
        rows = self.scalars_on_host()
        if not rows:
            return None
        return Record(optimizer=self.index, step=rows[-1][0], backward_pass=0, wall_time=rows[-1][1], hparams=[],
                      params=[], full=False, scalars=rows)

    # -- a split job's live statistics --------------------------------------------------------------------------
    def slots(self) -> list[Slot]:
        """Every selected parameter of the job's optimizer, in its order: the same on every rank (a ZeRO rank's
        local optimizer holds its partition only; the job's holds them all, in the order the user built it). Where
        the local optimizer is a PartitionView (DeepSpeed ZeRO, FSDP1's flat parameters), the job's are the named
        parameters inside every rank's flat partitions (``job_names``): the names its fragments are recorded under,
        never names given here to the job optimizer's own tensors (flat, or named after the fragments took theirs)."""
        optimizer = self.job_optimizer
        layout = layout_of(optimizer)
        if self._job_slots is None or self._job_slots[0] != layout:
            recorded = (list(self.optimizer.job_names) if isinstance(self.optimizer, PartitionView) else
                        [self.names.name(p, g, i, group) for g, group in enumerate(optimizer.param_groups)
                         for i, p in enumerate(group["params"])])
            self._job_slots = (layout, [Slot(name, name) for name in recorded
                                        if is_selected(name, self.settings.include, self.settings.exclude)])
        return self._job_slots[1]
