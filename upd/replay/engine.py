"""The verifier: replay each recorded step with the optimizer's own math and compare with what was recorded.

``check_step`` replays one (step, parameter) record and returns its ``Check``; ``verify`` asks the registry for the
rule of each recorded optimizer class and assembles the checks into a ``VerifyReport``. The engine knows nothing
about any optimizer. Tolerances are documented in docs/verify.md.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

import pandas as pd
import torch

from ..runfile import encoding, schema
from ..runfile.job import Job
from ..runfile.reader import OptimizerRun, ParamRecord, Run, RunFileError, open_run
from ..runfile.record import holds_part
from .explain import explain
from .registry import (NotReplayable, ReplayRule, ReplayRuleError, UnusableRecord, check_tolerances, lookup,
                       registered, same_shape)

# Exit codes of `upd verify` (documented in README, docs/verify.md and `upd --help`).
EXIT_MATCH, EXIT_MISMATCH, EXIT_UNUSABLE, EXIT_NOTHING_VERIFIABLE, EXIT_RULE_FAILED = 0, 1, 2, 3, 4


@dataclass
class Check:
    """The result of replaying one (step, parameter) record: one row of ``VerifyReport.checks``."""

    optimizer: int
    param: str
    record: int
    step: int
    status: str = "skipped"  # "match", "mismatch" or "skipped"
    max_abs_err: float = math.nan
    update_rel_err: float = math.nan
    err_to_tol: float = math.nan
    state_checked: bool = False
    state_err_to_tol: float = math.nan
    note: str = ""
    # Reduced-precision storage only: the tolerance relative to the update's size (median), for the report's
    # precision notes; not a column.
    precision_limit: float | None = None


CHECK_COLUMNS = [f.name for f in fields(Check) if f.name != "precision_limit"]
# A distributed job's checks also say which rank's file each came from, right after the optimizer; a single-file
# run's table has no rank column (its output is as it always was).
RANK = "rank"
JOB_CHECK_COLUMNS = CHECK_COLUMNS[:1] + [RANK] + CHECK_COLUMNS[1:]

_SPACING = {"float64": torch.finfo(torch.float64).eps, "float32": torch.finfo(torch.float32).eps,
            "float16": torch.finfo(torch.float16).eps, "bfloat16": torch.finfo(torch.bfloat16).eps}


def storage_eps(dtype_name: str | None) -> float:
    return _SPACING.get(dtype_name or "float32", _SPACING["float32"])


def elementwise_error(replayed: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """|replayed - recorded|, with equal infinities and NaN-against-NaN counted as exact agreement."""
    same = (replayed == recorded) | (torch.isnan(replayed) & torch.isnan(recorded))
    diff = (replayed - recorded).abs()
    return torch.where(same, torch.zeros_like(diff), torch.nan_to_num(diff, nan=float("inf")))


def tolerance(recorded: torch.Tensor, scale: float, *, eps: float, ulps: float, rtol: float) -> torch.Tensor:
    """Allowed error per element: a few units of storage spacing at the element, plus rtol of the tensor's scale.

    The first term covers the final float rounding of each element; the second the float32 rounding of the
    intermediate quantities (moments, denominators), which is bounded relative to the tensor's largest update.
    """
    finite_scale = scale if scale == scale and scale != float("inf") else 0.0
    return ulps * eps * recorded.abs().nan_to_num(posinf=0.0) + rtol * finite_scale + 1e-30


def compare(replayed: torch.Tensor, recorded: torch.Tensor, scale: float, *, eps: float, ulps: float,
            rtol: float) -> tuple[float, float]:
    """(max abs error, max error/tolerance ratio) of replayed against recorded; ratio <= 1 is a match."""
    err = elementwise_error(replayed, recorded)
    if err.numel() == 0:
        return 0.0, 0.0
    tol = tolerance(recorded, scale, eps=eps, ulps=ulps, rtol=rtol)
    return float(err.max()), float((err / tol).max())


def replay_hparams(group: dict) -> dict:
    """A recorded param group as rules take it: tensor hyperparameters unwrapped (see encoding.hparam_value)."""
    return {k: encoding.hparam_value(v) for k, v in group.items()}


def _largest(t: torch.Tensor) -> float:
    """The largest finite magnitude in t (0 for an empty tensor): the scale tolerances are relative to."""
    return float(t.abs().nan_to_num(posinf=0.0).max()) if t.numel() else 0.0


@dataclass
class VerifyReport:
    """Result of ``upd.verify``: ``checks`` has one row per (optimizer, param, record); for a distributed job one
    per (optimizer, rank, param, record), with a ``rank`` column (each rank's file is replayed as it is: its shard,
    partition or replica) and ``record`` the record in that rank's file."""

    path: str
    checks: pd.DataFrame
    problems: list = field(default_factory=list)  # why whole optimizers could not be checked
    precision_notes: list = field(default_factory=list)  # limits set by reduced-precision storage
    params_not_optimized: list = field(default_factory=list)  # model parameters no recorded optimizer holds
    live: bool = False  # the run was being written: these are the records committed when it was opened
    world_size: int | None = None  # a distributed job's: its checks have a rank column

    @property
    def matched(self) -> int:
        return int((self.checks["status"] == "match").sum())

    @property
    def mismatched(self) -> int:
        return int((self.checks["status"] == "mismatch").sum())

    @property
    def skipped(self) -> int:
        return int((self.checks["status"] == "skipped").sum())

    @property
    def exit_code(self) -> int:
        if self.mismatched:
            return EXIT_MISMATCH
        if not self.matched:
            return EXIT_NOTHING_VERIFIABLE
        return EXIT_MATCH

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_MATCH

    def by_param(self) -> pd.DataFrame:
        """Per parameter: checked/matched/mismatched/skipped counts, worst errors, first mismatching step (for a job
        over all its ranks, with the rank of the first mismatch, also named in the explanation)."""
        rows = []
        by_rank = RANK in self.checks.columns
        for (opt, param), df in self.checks.groupby(["optimizer", "param"], sort=False):
            bad = df[df["status"] == "mismatch"]
            if by_rank:
                bad = bad.sort_values(["step", RANK], kind="stable")
            rows.append({
                "optimizer": opt, "param": param, "checked": int((df["status"] != "skipped").sum()),
                "matched": int((df["status"] == "match").sum()), "mismatched": len(bad),
                "skipped": int((df["status"] == "skipped").sum()),
                "max_abs_err": df["max_abs_err"].max(), "update_rel_err": df["update_rel_err"].max(),
                "err_to_tol": df["err_to_tol"].max(), "state_err_to_tol": df["state_err_to_tol"].max(),
                "first_mismatch_step": int(bad["step"].min()) if len(bad) else None,
                "explanation": bad.sort_values("step", kind="stable")["note"].iloc[0] if len(bad) else "",
                "result": "FAIL" if len(bad) else ("ok" if (df["status"] == "match").any() else "skipped"),
            })
            if by_rank:
                first = int(bad.sort_values("step", kind="stable")[RANK].iloc[0]) if len(bad) else None
                rows[-1]["first_mismatch_rank"] = first
                if first is not None and not rows[-1]["explanation"].startswith("replica on rank"):
                    rows[-1]["explanation"] = f"rank {first}: " + rows[-1]["explanation"]
        table = pd.DataFrame(rows)
        if by_rank and len(table):
            table["first_mismatch_rank"] = table["first_mismatch_rank"].astype("Int64")  # a rank, or <NA>
        return table

    def summary(self) -> str:
        lines = [f"{self.path}: {self.matched} step-parameter checks matched, {self.mismatched} mismatched, "
                 f"{self.skipped} skipped"]
        if self.world_size is not None:
            lines.append(f"  distributed job of {self.world_size} processes: each rank's file replayed on its own "
                         "(shard by shard), replicas compared")
        if self.live:
            lines.append("  the run is being written: checked the records committed when it was opened")
        lines += [f"  {p}" for p in self.problems]
        if self.params_not_optimized:
            lines.append("  model parameters in no recorded optimizer (never updated): "
                         + ", ".join(self.params_not_optimized))
        lines += [f"  precision: {n}" for n in self.precision_notes]
        if self.mismatched:
            bad = self.checks[self.checks["status"] == "mismatch"].sort_values("err_to_tol", ascending=False)
            for _, r in bad.head(5).iterrows():
                where = f" rank {r[RANK]}" if RANK in r else ""
                lines.append(f"  MISMATCH {r['param']} step {r['step']}{where}: max abs err {r['max_abs_err']:.3g} "
                             f"({r['err_to_tol']:.3g}x tolerance){'; ' + r['note'] if r['note'] else ''}")
        else:
            skipped = self.checks[self.checks["status"] == "skipped"]["note"].drop_duplicates().head(3)
            lines += [f"  skipped: {n}" for n in skipped]
        return "\n".join(lines)


def verify(run, *, rtol: float | None = None, ulps: float | None = None) -> VerifyReport:
    """Replay every recorded step of every optimizer and compare with the recorded result.

    ``run`` is a path or an open ``upd.Run`` or ``Job`` (a distributed job: every rank's file is replayed as it is,
    shard by shard, and replicas several ranks hold whole are checked to agree). ``rtol``/``ulps`` override each
    rule's documented tolerance (finite, >= 0: ValueError otherwise). Raises ``RunFileError`` for an unusable file
    and ``upd.replay.ReplayRuleError`` when a replay rule raises (a bug in the rule).
    """
    check_tolerances(rtol, ulps)
    own = not isinstance(run, (Run, Job))
    if own:
        run = open_run(run)
    try:
        job = run if isinstance(run, Job) else None
        files = job.ranks if job is not None else {None: run}
        checks, problems = [], []  # checks: (rank or None, Check)
        per_param: dict[tuple[int, str], tuple[ParamRecord, list]] = {}  # for the precision notes, over ranks
        for rank, file in files.items():
            for opt in file.optimizers:
                replay = OptimizerReplay.of(file, opt, rtol=rtol, ulps=ulps)
                if replay.rule is None:
                    problem = (f"optimizer {opt.index} ({opt.class_name}, torch {file.torch_version}) has no replay "
                               f"rule; registered: {', '.join(registered())}")
                    if problem not in problems:
                        problems.append(problem)
                for p in opt.param_records.values():
                    param_checks = [check_step(replay, p, row) for row in range(p.num_rows)]
                    checks += [(rank, check) for check in param_checks]
                    per_param.setdefault((opt.index, p.name), (p, []))[1].extend(param_checks)
        if job is not None:
            checks += replica_checks(job.ranks, ulps=ulps)
        notes = [note for p, param_checks in per_param.values() if (note := _precision_note(p, param_checks))]
        columns = CHECK_COLUMNS if job is None else JOB_CHECK_COLUMNS
        table = pd.DataFrame([{RANK: rank, **{c: getattr(check, c) for c in CHECK_COLUMNS}} for rank, check in checks],
                             columns=columns)
        return VerifyReport(path=os.fspath(run.path), checks=table, problems=problems, precision_notes=notes,
                            params_not_optimized=list(run.params_not_optimized), live=run.live,
                            world_size=job.world_size if job is not None else None)
    finally:
        if own:
            run.close()


@dataclass
class OptimizerReplay:
    """What the checks of one recorded optimizer share: its rule, tolerance overrides, decoded param groups."""

    run: Run
    opt: OptimizerRun
    rule: ReplayRule | None
    state_recorded: bool
    rtol: float | None = None
    ulps: float | None = None
    _groups: dict = field(default_factory=dict)  # record -> that record's param groups, as rules take them

    @classmethod
    def of(cls, run: Run, opt: OptimizerRun, *, rtol=None, ulps=None) -> OptimizerReplay:
        return cls(run=run, opt=opt, rule=lookup(opt.class_name, opt.meta.get("mro", ()), run.torch_version),
                   state_recorded="state" in run.options.get("what", schema.WHAT_CHOICES), rtol=rtol, ulps=ulps)

    def group(self, record: int, index: int) -> dict:
        if record not in self._groups:
            self._groups[record] = [replay_hparams(g) for g in self.opt.hparams(record)]
        groups = self._groups[record]
        if index >= len(groups):
            raise RunFileError(f"{self.run.path}: optimizer {self.opt.index}: records/hparams[{record}] has "
                               f"{len(groups)} param group(s), no group {index}")
        return groups[index]


def check_step(replay: OptimizerReplay, p: ParamRecord, row: int) -> Check:
    """Replay one recorded (step, parameter) and compare it with the record: the parameter after the step, and,
    when the next step was recorded, the optimizer state and the parameter before it."""
    opt, rule = replay.opt, replay.rule
    record = int(p.records[row])
    step = int(opt.steps[record])
    check = Check(optimizer=opt.index, param=p.name, record=record, step=step)
    missing = [k for k in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER) if k not in p.kinds]
    if rule is None:
        check.note = f"no replay rule for {opt.class_name}"
        return check
    if holds_part(p.meta):
        # A rank's shard of a distributed parameter replays on its own only under elementwise math.
        if rule.needs_whole_tensor:
            check.note = f"{rule.name} needs the whole tensor; this parameter is a shard"
            return check
        if p.numel == 0:
            check.note = "this rank holds no part of this parameter (an empty shard)"
            return check
    if missing:
        check.note = f"{', '.join(missing)} not recorded"
        return check
    if str(p.dtype or "").startswith("complex"):
        # torch replays complex parameters as (real, imag) pairs; the rules work on real tensors only
        check.note = f"complex parameters ({p.dtype}) are not replayed"
        return check
    before = p.read(schema.KIND_PARAM, row).double()
    grad = p.read(schema.KIND_GRAD, row).double()
    after = p.read(schema.KIND_PARAM_AFTER, row).double()
    if not replay.state_recorded and step != 0:
        check.note = "optimizer state not recorded (what= excluded 'state')"
        return check
    state = {k: v.double() for k, v in p.state_at(row).items()} if replay.state_recorded else {}
    group = replay.group(record, p.param_group or 0)
    where = f"optimizer {opt.index}, parameter {p.name!r}, step {step}"
    try:
        replayed = rule.replay(before, grad, state, group, step)
    except NotReplayable as exc:
        check.note = str(exc)
        return check
    except RunFileError:
        raise
    except UnusableRecord as exc:
        raise RunFileError(f"{replay.run.path}: {where}: {exc} (replay rule {rule.function_name})") from exc
    except Exception as exc:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ReplayRuleError(f"{replay.run.path}: replay rule {rule.function_name} (for {rule.name}) failed on "
                              f"{where}: {message[:300]}") from exc

    eps = storage_eps(p.storage_dtype(schema.KIND_PARAM_AFTER))
    reduced = eps > _SPACING["float32"]
    rule_ulps = rule.ulps if replay.ulps is None else replay.ulps
    rule_rtol = rule.rtol if replay.rtol is None else replay.rtol
    # Reduced-precision storage rounds the inputs too: the update can only be checked to that precision.
    rtol = max(rule_rtol, 4 * eps) if reduced else rule_rtol
    update = replayed.param - before
    scale = _largest(update)
    check.max_abs_err, check.err_to_tol = compare(replayed.param, after, scale, eps=eps, ulps=rule_ulps, rtol=rtol)
    recorded_scale = _largest(after - before)
    check.update_rel_err = check.max_abs_err / recorded_scale if recorded_scale > 0 else math.nan
    if reduced and scale > 0:
        check.precision_limit = (float(tolerance(after, scale, eps=eps, ulps=rule_ulps, rtol=rtol).median())
                                 / float(update.abs().median().clamp_min(1e-30)))
    nxt = _next_row(p, opt, row, record)
    next_state = None
    continuous = True
    if nxt is not None:
        if replay.state_recorded:
            next_state = {k: v.double() for k, v in p.state_at(nxt).items()}
        # Nothing but the optimizer should touch a parameter between two consecutive steps.
        continuous = bool((elementwise_error(p.read(schema.KIND_PARAM, nxt).double(), after) == 0).all())
    conflict = _shape_conflict(next_state or {}, replayed.state)
    if conflict:
        raise RunFileError(f"{replay.run.path}: {where}: {conflict} (replay rule {rule.function_name})")
    state_ratio = _state_error(next_state, replayed.state, eps, rule_ulps, rtol) if next_state else None
    if state_ratio is not None:
        check.state_checked, check.state_err_to_tol = True, state_ratio
    param_ok = check.err_to_tol <= 1.0
    state_ok = state_ratio is None or state_ratio <= 1.0
    check.status = "match" if param_ok and state_ok and continuous else "mismatch"
    if not (param_ok and state_ok):
        def matches(alt_param, alt_state):
            if compare(alt_param, after, _largest(alt_param - before), eps=eps, ulps=rule_ulps, rtol=rtol)[1] > 1.0:
                return False
            alt_state_ratio = _state_error(next_state, alt_state, eps, rule_ulps, rtol) if next_state else None
            return alt_state_ratio is None or alt_state_ratio <= 1.0

        def replay_with(alt_grad, alt_group):
            return rule.replay(before, alt_grad, {k: v.clone() for k, v in state.items()}, alt_group, step)

        why = explain(replay_with, before, grad, after, group, next_state, matches)
        what = "recorded update differs from the replayed one" if not param_ok else \
            "next record's optimizer state differs from the replayed state"
        check.note = what + (f": {why}" if why else "")
    elif not continuous:
        check.note = "parameter changed outside the optimizer before the next step"
    return check


def _precision_note(p: ParamRecord, checks: list[Check]) -> str | None:
    """How closely reduced-precision storage let this parameter's updates be checked (median over its steps)."""
    limits = sorted(c.precision_limit for c in checks if c.precision_limit is not None)
    if not limits:
        return None
    return (f"{p.name}: stored as {p.storage_dtype(schema.KIND_PARAM_AFTER)}, so each element is verified only to "
            f"about {limits[len(limits) // 2]:.2g}x its own update size")


def _next_row(p: ParamRecord, opt: OptimizerRun, row: int, record: int) -> int | None:
    """The row of the very next optimizer step for this parameter, if it was recorded."""
    nxt = row + 1
    if nxt >= p.num_rows or int(p.records[nxt]) != record + 1:
        return None
    return nxt if int(opt.steps[record + 1]) == int(opt.steps[record]) + 1 else None


def _shape_conflict(recorded: dict, replayed_state: dict) -> str | None:
    """Why the state recorded before the next step cannot be compared with the replayed state, or None."""
    for key, value in replayed_state.items():
        if key in recorded and not same_shape(recorded[key], value):
            return (f"state {key!r} has shape {tuple(recorded[key].shape)} at the next step, the replayed state "
                    f"{tuple(value.shape)}")
    return None


def _state_error(recorded: dict | None, replayed_state: dict, eps, ulps, rtol) -> float | None:
    """Worst error/tolerance of the replayed state against the state recorded at the next step."""
    worst = None
    for key, value in replayed_state.items():
        if key not in recorded:
            continue
        rec = recorded[key].double()
        _, ratio = compare(value, rec, _largest(rec), eps=eps, ulps=ulps, rtol=rtol)
        worst = ratio if worst is None else max(worst, ratio)
    return worst


# -- replica agreement (a distributed job recorded with ranks="all") ------------------------------------------------
# Data-parallel replicas start from one broadcast copy and apply the same all-reduced gradient with the same
# elementwise math, so they are bitwise equal; a replica that drifts is a real bug (a rank that skipped an
# all-reduce, a desynchronised seed or scheduler) that no single rank's replay can see. One unit of storage spacing
# per element is allowed unless `ulps=` says otherwise.
REPLICA_ULPS = 1.0


def _replicated(records: list[ParamRecord]) -> bool:
    """Whether these records of one parameter (one per rank) each hold the parameter whole: same shape everywhere,
    and no rank holds a shard of a bigger tensor (a DTensor's ``global_shape`` larger than what is stored)."""
    return len(records) > 1 and len({p.shape for p in records}) == 1 and not any(holds_part(p.meta) for p in records)


def _rows_by_step(p: ParamRecord) -> dict[int, int]:
    steps = p.optimizer.steps
    return {int(steps[int(record)]): row for row, record in enumerate(p.records)}


def _replica_divergence(reference: ParamRecord, replica: ParamRecord, ulps: float):
    """(step, row in the replica, kind, max abs diff, diff/tolerance) where the replica first differs from the
    reference at a step both recorded (the parameter before the step, then after it), or None."""
    ref_rows, rep_rows = _rows_by_step(reference), _rows_by_step(replica)
    kinds = [k for k in (schema.KIND_PARAM, schema.KIND_PARAM_AFTER) if k in reference.kinds and k in replica.kinds]
    eps = storage_eps(replica.storage_dtype(schema.KIND_PARAM_AFTER) if kinds else None)
    for step in sorted(set(ref_rows) & set(rep_rows)):
        for kind in kinds:
            expected = reference.read(kind, ref_rows[step]).double()
            got = replica.read(kind, rep_rows[step]).double()
            err = elementwise_error(got, expected)
            if err.numel() == 0:
                continue
            ratio = float((err / tolerance(expected, 0.0, eps=eps, ulps=ulps, rtol=0.0)).max())
            if ratio > 1.0:
                return step, rep_rows[step], kind, float(err.max()), ratio
    return None


def replica_checks(ranks: dict, *, ulps: float | None = None) -> list[tuple[int, Check]]:
    """Replica agreement of a job's rank files ({rank: Run}): every parameter that several ranks hold whole is
    compared, at each step they all recorded, with the copy of the lowest rank holding it (rank 0 normally).

    Returns (rank, mismatch Check) for the first step at which each replica of each parameter diverges; nothing
    for replicas that agree, and nothing for sharded or partitioned parameters (each rank holds its own part)."""
    ulps = REPLICA_ULPS if ulps is None else ulps
    found = []
    by_param: dict[tuple[int, str], dict[int, ParamRecord]] = {}
    for rank in sorted(ranks):
        for opt in ranks[rank].optimizers:
            for name, p in opt.param_records.items():
                by_param.setdefault((opt.index, name), {})[rank] = p
    for (opt_index, name), held in by_param.items():
        if not _replicated(list(held.values())):
            continue
        reference_rank, *replica_ranks = sorted(held)
        for rank in replica_ranks:
            divergence = _replica_divergence(held[reference_rank], held[rank], ulps)
            if divergence is None:
                continue
            step, row, kind, max_diff, ratio = divergence
            when = "before" if kind == schema.KIND_PARAM else "after"
            check = Check(optimizer=opt_index, param=name, record=int(held[rank].records[row]), step=step,
                          status="mismatch", max_abs_err=max_diff, err_to_tol=ratio,
                          note=f"replica on rank {rank} differs from rank {reference_rank} at step {step} (max abs "
                               f"diff {max_diff:.3g} in the parameter {when} the step)")
            found.append((rank, check))
    return found
