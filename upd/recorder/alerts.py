"""Early warnings, live (``upd.record(..., alerts=True)``): the alert rules of ``upd.alert_rules`` applied to each
statistics step as it is written, on the run file's writer thread, from the values already on the host.

``LiveAlerts`` is an internal consumer of the sink feed (``upd.sinks.feed``): it sees each written record's
statistics before the sinks do, attaches the step's alerts to its ``SinkStep`` (``alerts``; every sink shows their
counts as ``alerts/<kind>``), stores each new alert in the run's events table through the writer thread's own
writer, and leaves for the training thread what must happen there: the warnings (``upd.TrainingAlert``) and the
flight recorder's dump, both taken by the next step's post-hook (``take``).

Nothing here runs on the training thread but ``take``. The rules run once per step on whole columns (one numpy call
per rule over all parameters; the update-norm baseline is a (spike_window, parameters) ring of the previous
norms): bit-identical to ``alert_rules.check_step`` fed the same values one parameter at a time
(tests/recorder/test_alerts.py checks it), at a fraction of its cost.

Rate limits. An alert is *new* at a step when the same (kind, parameter) did not fire at that optimizer's
previous statistics step: a weight outside the band for a thousand steps is one event, not a thousand. Events are
the new alerts, at most MAX_EVENTS per run (the rest counted, said at close). Warnings: one per (step, kind) that
names a (kind, parameter) never warned about before, at most MAX_WARNINGS, then one saying that the rest are in
``run.events()`` only.
"""
from __future__ import annotations

import collections
import math
import threading
from typing import Callable, Mapping

import numpy as np

from .. import alert_rules as rules_
from ..alert_rules import Alert, AlertRules
from ..runfile.stats_table import StatsRows
from ..sinks.base import SinkStep

MAX_WARNINGS = 10  # individual TrainingAlert warnings per recording, then one "see run.events()"
MAX_EVENTS = 10_000  # events stored per recording (the reader's bound, upd/runfile/schema.py, is above it)
NAMES_IN_WARNING = 4  # parameter names one warning lists before "and N more"
# The alert kinds that dump the flight recorder's kept steps (with flight_recorder=K): the acute ones, whose steps
# are worth their full tensors. A weight drifting out of the band is not (it would dump on its first step).
DUMP_KINDS = (rules_.NONFINITE, rules_.UPDATE_SPIKE)


class _OptimizerState:
    """One optimizer's live state: its parameter names (by identity of the statistics' names list), which of them
    are weights, the ring of previous update norms, and what fired at its previous statistics step."""

    def __init__(self, names: list, weights: np.ndarray, window: int):
        self.names = names
        self.weights = weights
        self.ring = np.full((window, len(names)), np.nan)
        self.filled = 0  # rows of the ring written so far (up to window)
        self.at = 0  # the next row to write
        self.firing: set = set()  # (kind, param) that fired at the previous statistics step

    def baselines(self, rules: AlertRules) -> np.ndarray:
        """alert_rules.baseline_of for every parameter at once (NaN below spike_min_history known norms)."""
        out = np.full(len(self.names), np.nan)
        if self.filled < rules.spike_min_history:
            return out
        # The median of each column's known norms, as np.median takes it (the middle one, or the mean of the two
        # middle ones: (a + b) / 2), from one sort: NaN sorts last. numpy's nanmedian goes through masked arrays,
        # ten times slower on a ring this small.
        ordered = np.sort(self.ring[:self.filled], axis=0)
        known = (~np.isnan(ordered)).sum(axis=0)
        enough = np.flatnonzero(known >= rules.spike_min_history)
        if len(enough):
            k = known[enough]
            low, high = ordered[(k - 1) // 2, enough], ordered[k // 2, enough]
            out[enough] = np.where(k % 2 == 1, low, (low + high) / 2)
        return out

    def add(self, norms: np.ndarray) -> None:
        self.ring[self.at] = np.where(np.isfinite(norms) & (norms > 0), norms, np.nan)
        self.at = (self.at + 1) % len(self.ring)
        self.filled = min(self.filled + 1, len(self.ring))

    def renamed(self, names: list, weights: np.ndarray) -> "_OptimizerState":
        """The same history for a new list of names (add_param_group, a swapped tensor): kept by name."""
        new = _OptimizerState(names, weights, len(self.ring))
        old = {n: i for i, n in enumerate(self.names)}
        order = np.r_[self.at:len(self.ring), 0:self.at] if self.filled == len(self.ring) else np.arange(self.filled)
        for j, name in enumerate(names):
            if name in old:
                new.ring[:len(order), j] = self.ring[order, old[name]]
        new.filled, new.at = len(order), len(order) % len(self.ring)
        new.firing = self.firing
        return new


def _columns(stats) -> tuple[list, dict]:
    """(names, {column: array over the names}) of a record's statistics (StatsRows or {name: {column: value}})."""
    if isinstance(stats, StatsRows):
        return stats.names, {c: stats.table[:, j].astype(np.float64) for j, c in enumerate(stats.columns)}
    names = list(stats)
    columns = sorted({c for values in stats.values() for c in values})
    return names, {c: np.array([stats[n].get(c, math.nan) for n in names], dtype=np.float64) for c in columns}


def step_alerts(step: int, names: list, values: Mapping[str, np.ndarray], weights: np.ndarray,
                baselines: np.ndarray, rules: AlertRules) -> list[Alert]:
    """Every rule over one step's columns (one element per parameter), in check_step's order per parameter."""
    found: list[list[Alert]] = [[] for _ in names]
    missing = np.full(len(names), np.nan)  # a column this step did not measure (the lean set's steps)
    values = {c: values.get(c, missing) for c in (*rules_.NONFINITE_COLUMNS, rules_.UPDATE_TO_DATA,
                                                  rules_.UPDATE_NORM, rules_.GRAD_NORM, rules_.GRAD_ZERO_FRAC,
                                                  rules_.EXP_AVG_MEAN, rules_.EXP_AVG_STD, rules_.EXP_AVG_SQ_MEAN)}
    bad = rules_.nonfinite(values)
    band = np.where(weights, rules_.out_of_band(values, rules), 0)
    stopped = rules_.not_moving(values, rules)
    spike = rules_.update_spike(values, baselines, rules)
    collapsed = rules_.second_moment_collapsed(values, rules)
    ratio = rules_.exp_avg_ratio(values)
    ratio_fires = np.isfinite(ratio) & (ratio > rules.exp_avg_ratio_limit)
    ratio_column, second = values[rules_.UPDATE_TO_DATA], values[rules_.EXP_AVG_SQ_MEAN]
    for i in np.flatnonzero((bad > 0) | (band != 0) | (stopped != rules_.MOVING) | (spike != 0) | collapsed
                            | ratio_fires):
        name, out = names[i], found[i]
        if bad[i] > 0:
            out.append(Alert(rules_.NONFINITE, name, step, float(bad[i])))
        if band[i] != 0:
            out.append(Alert(rules_.OUT_OF_BAND, name, step, float(ratio_column[i])))
        if stopped[i] != rules_.MOVING:
            out.append(Alert(rules_.NOT_MOVING, name, step, float(stopped[i])))
        if spike[i]:
            out.append(Alert(rules_.UPDATE_SPIKE, name, step, float(spike[i])))
        if collapsed[i]:
            out.append(Alert(rules_.SECOND_MOMENT_COLLAPSE, name, step, float(np.sqrt(max(float(second[i]), 0.0)))))
        if ratio_fires[i]:
            out.append(Alert(rules_.EXP_AVG_RATIO, name, step, float(ratio[i])))
    return [a for per_param in found for a in per_param]


def event_of(optimizer: int, alert: Alert, wall_time: float) -> dict:
    """An events-table entry (docs/format.md, ``events``)."""
    return {"optimizer": int(optimizer), "step": int(alert.step), "kind": alert.kind, "param": alert.param,
            "value": alert.value if math.isfinite(alert.value) else None, "wall_time": float(wall_time)}


class LiveAlerts:
    """The live checker of one recording. ``check(records, steps)`` runs on the writer thread; ``take()`` on the
    training thread returns what is due there: (warning texts, a dump reason or None)."""

    def __init__(self, rules: AlertRules, dump: bool = False):
        self.rules = rules
        self.dump = dump  # a flight recorder is on: DUMP_KINDS alerts dump it
        self.store: Callable[[list], None] | None = None  # writes events on the writer thread (set with the writer)
        self._states: dict[int, _OptimizerState] = {}
        self._weights_of: dict[int, tuple[int, np.ndarray]] = {}  # optimizer -> (id(names), weights mask)
        self._warned: set = set()  # (kind, param) warned about
        self._warnings = 0
        self._lock = threading.Lock()  # the writer thread puts, the training thread takes
        self._due_warnings: collections.deque = collections.deque()
        self._dump_reason: str | None = None
        self.counts: collections.Counter = collections.Counter()  # new alerts per kind
        self.events_stored = 0
        self.events_dropped = 0

    # -- the writer thread --------------------------------------------------------------------------------------
    def check_records(self, records, steps: list[SinkStep]) -> list[SinkStep]:
        """The sink steps of `records` (sink_steps' output, in the same order), each statistics step with its
        alerts attached; new alerts stored and queued for the training thread."""
        by_step = {}
        for rec in records:
            if rec.stats:
                by_step[(int(rec.optimizer), int(rec.step))] = rec
        out = []
        for s in steps:
            rec = by_step.get((s.optimizer, s.step))
            if rec is None or not s.params:
                out.append(s)
                continue
            names, values = _columns(rec.stats)
            alerts = self.check(s.optimizer, s.step, s.wall_time, names, values, self._weights(rec, names))
            out.append(SinkStep(optimizer=s.optimizer, step=s.step, wall_time=s.wall_time, params=s.params,
                                scalars=s.scalars, alerts=tuple(alerts)))
        return out

    def _weights(self, rec, names: list) -> np.ndarray:
        cached = self._weights_of.get(rec.optimizer)
        if cached is None or cached[0] is not names:
            meta = rec.stats_meta or {}
            mask = np.array([rules_.is_weight((meta.get(n) or {}).get("shape", ())) for n in names], dtype=bool)
            cached = (names, mask)
            self._weights_of[rec.optimizer] = cached
        return cached[1]

    def check(self, optimizer: int, step: int, wall_time: float, names: list, values: Mapping[str, np.ndarray],
              weights: np.ndarray) -> list[Alert]:
        """One statistics step of one optimizer: its alerts (all of them, for the sinks); the new ones stored,
        warned about and, with a flight recorder, a dump asked for."""
        state = self._states.get(optimizer)
        if state is None:
            state = _OptimizerState(names, weights, self.rules.spike_window)
        elif state.names is not names and list(state.names) != list(names):
            state = state.renamed(names, weights)
        else:
            state.names, state.weights = names, weights
        self._states[optimizer] = state
        alerts = step_alerts(step, names, values, weights, state.baselines(self.rules), self.rules)
        state.add(np.asarray(values.get(rules_.UPDATE_NORM, np.full(len(names), np.nan)), dtype=np.float64))
        firing = {(a.kind, a.param) for a in alerts}
        new = [a for a in alerts if (a.kind, a.param) not in state.firing]
        state.firing = firing
        if new:
            self._new_alerts(optimizer, new, wall_time)
        return alerts

    def _new_alerts(self, optimizer: int, new: list[Alert], wall_time: float) -> None:
        self.counts.update(a.kind for a in new)
        room = max(0, MAX_EVENTS - self.events_stored)
        kept, self.events_dropped = new[:room], self.events_dropped + max(0, len(new) - room)
        if kept and self.store is not None:
            self.store([event_of(optimizer, a, wall_time) for a in kept])
            self.events_stored += len(kept)
        texts = []
        by_kind: dict[str, list[Alert]] = {}
        for a in new:
            by_kind.setdefault(a.kind, []).append(a)
        for kind, group in by_kind.items():
            fresh = [a for a in group if (kind, a.param) not in self._warned]
            if not fresh or self._warnings > MAX_WARNINGS:
                continue
            self._warned.update((kind, a.param) for a in fresh)
            self._warnings += 1
            if self._warnings > MAX_WARNINGS:
                texts.append(f"torch-upd: more training alerts than the {MAX_WARNINGS} warned about; they are in "
                             "the run's events (run.events(), upd info, upd analyze).")
            else:
                texts.append(warning_text(optimizer, group))
        reason = None
        if self.dump:
            acute = [a for a in new if a.kind in DUMP_KINDS]
            if acute:
                reason = f"alert at step {acute[0].step}: {acute[0].text()}"
        with self._lock:
            self._due_warnings.extend(texts)
            if reason is not None and self._dump_reason is None:
                self._dump_reason = reason

    # -- the training thread ------------------------------------------------------------------------------------
    def take(self) -> tuple[list[str], str | None]:
        """The warnings due and the dump asked for since the last call (each handed out once)."""
        with self._lock:
            texts, reason = list(self._due_warnings), self._dump_reason
            self._due_warnings.clear()
            self._dump_reason = None
        return texts, reason

    def closing_text(self) -> str | None:
        """What the close says when alerts were stored beyond the warnings or dropped beyond MAX_EVENTS."""
        total = sum(self.counts.values())
        if not total or (self._warnings <= MAX_WARNINGS and not self.events_dropped):
            return None
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.counts.most_common())
        dropped = f"; {self.events_dropped} not stored (more than {MAX_EVENTS})" if self.events_dropped else ""
        return f"torch-upd: {total} training alerts in all ({kinds}){dropped}: run.events() lists them."


def warning_text(optimizer: int, group: list[Alert]) -> str:
    """One warning for the new alerts of one kind at one step, naming their parameters."""
    first = group[0]
    names = [a.param for a in group]
    shown = ", ".join(f"{a.param} ({a.value:.3g})" for a in group[:NAMES_IN_WARNING])
    more = f" and {len(names) - NAMES_IN_WARNING} more" if len(names) > NAMES_IN_WARNING else ""
    where = f"optimizer {optimizer} " if optimizer else ""
    return (f"torch-upd alert: {where}step {first.step}: {rules_.ALERT_WORDS[first.kind]}: {shown}{more} "
            f"(kind {first.kind!r}; run.events() lists every alert)")

