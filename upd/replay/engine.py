"""The verifier: replay each recorded step with the optimizer's own math and compare with what was recorded.

``param_checks`` replays one parameter's recorded steps (block by block, blocks.py) and returns a ``Check`` per
step; ``verify`` asks the registry for the rule of each recorded optimizer class and assembles the checks into a
``VerifyReport`` (``--jobs``: parameters spread over processes, parallel.py). The engine knows nothing
about any optimizer. Tolerances are documented in docs/verify.md.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

import pandas as pd
import torch

from .. import exit_codes
from ..runfile import encoding, schema, tensor_blocks
from ..runfile.job import Job
from ..runfile.reader import OptimizerRun, ParamRecord, Run, RunFileError
from ..runfile.opening import open_run
from ..runfile.record import holds_part
from . import batch, blocks, hparams, parallel, skipped_steps
from .explain import explain
from .registry import (NotReplayable, ReplayRule, ReplayRuleError, check_tolerances, lookup, registered,
                       same_shape)

# Exit codes of `upd verify` (documented in README, docs/verify.md and `upd --help`).
EXIT_MATCH, EXIT_MISMATCH, EXIT_UNUSABLE, EXIT_NOTHING_VERIFIABLE, EXIT_RULE_FAILED = (
    exit_codes.EXIT_MATCH, exit_codes.EXIT_MISMATCH, exit_codes.EXIT_UNUSABLE, exit_codes.EXIT_NOTHING_VERIFIABLE,
    exit_codes.EXIT_RULE_FAILED)


@dataclass
class Check:
    """The result of replaying one (step, parameter) record: one row of ``VerifyReport.checks``."""

    optimizer: int
    param: str
    record: int
    step: int
    status: str = "skipped"  # "match", "mismatch", "inconclusive" or "skipped"
    max_abs_err: float = math.nan
    update_rel_err: float = math.nan
    err_to_tol: float = math.nan
    state_checked: bool = False
    state_err_to_tol: float = math.nan
    note: str = ""
    # Of the elements the replayed step moves, the fraction whose update is larger than its tolerance: where a
    # missing or doubled update would have been caught. A check that passes with less than MIN_RESOLVED of them is
    # "inconclusive" (reduced-precision storage, an update below the storage's spacing).
    update_resolved: float = math.nan


CHECK_COLUMNS = [f.name for f in fields(Check)]
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
    parallelism: str | None = None  # a distributed job's, as its files say (runfile.schema.PARALLELISMS)
    # a distributed job's parameters by how they are held: {"sharded" | "whole on one rank" | "replicated": count}
    held: dict = field(default_factory=dict)

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
    def inconclusive(self) -> int:
        """Checks that passed with a tolerance as large as the update: neither a match nor a mismatch."""
        return int((self.checks["status"] == "inconclusive").sum())

    @property
    def exit_code(self) -> int:
        if self.mismatched:
            return EXIT_MISMATCH
        if not self.matched:  # nothing conclusively verified: skipped, inconclusive, or nothing recorded
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
                "inconclusive": int((df["status"] == "inconclusive").sum()),
                "first_mismatch_step": int(bad["step"].min()) if len(bad) else None,
                "explanation": bad.sort_values("step", kind="stable")["note"].iloc[0] if len(bad) else "",
                "result": "FAIL" if len(bad) else ("ok" if (df["status"] == "match").any() else
                                                   "inconclusive" if (df["status"] == "inconclusive").any() else
                                                   "skipped"),
            })
            if by_rank:
                first = int(bad.sort_values("step", kind="stable")[RANK].iloc[0]) if len(bad) else None
                rows[-1]["first_mismatch_rank"] = first
                if first is not None and not rows[-1]["explanation"].startswith("replica on rank"):
                    rows[-1]["explanation"] = f"rank {first}: " + rows[-1]["explanation"]
        table = pd.DataFrame(rows)
        if len(table):
            table["first_mismatch_step"] = table["first_mismatch_step"].astype("Int64")  # a step, or <NA>
        if by_rank and len(table):
            table["first_mismatch_rank"] = table["first_mismatch_rank"].astype("Int64")  # a rank, or <NA>
        return table

    def summary(self) -> str:
        lines = [f"{self.path}: {self.matched} step-parameter checks matched, {self.mismatched} mismatched, "
                 + (f"{self.inconclusive} inconclusive, " if self.inconclusive else "") + f"{self.skipped} skipped"]
        if self.inconclusive:
            lines.append(f"  inconclusive: {self.inconclusive} checks passed only because the tolerance is as large as "
                         "the update (reduced-precision storage, or updates below the storage's precision): a "
                         "missing or doubled update would have passed too, so they verify nothing")
        if self.world_size is not None:
            lines.append(f"  distributed job of {self.world_size} processes"
                         + (f" ({self.parallelism})" if self.parallelism else "") + ": " + _held_text(self.held))
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


def _held(job) -> dict:
    """How a job's parameters are held: {"sharded" | "whole on one rank" | "replicated": how many}."""
    held: dict = {}
    table = job.params()
    for layout, ranks in zip(table["layout"], table["ranks"]):
        kind = "sharded" if layout == "sharded" else "replicated" if len(ranks) > 1 else "whole on one rank"
        held[kind] = held.get(kind, 0) + 1
    return held


def _held_text(held: dict) -> str:
    """What verify did with a job's parameters, by how they are held (the summary's line about the job)."""
    parts = []
    if held.get("sharded"):
        parts.append(f"{held['sharded']} sharded parameter(s) checked part by part on the ranks holding them")
    if held.get("whole on one rank"):
        parts.append(f"{held['whole on one rank']} held whole by one rank checked there")
    if held.get("replicated"):
        parts.append(f"{held['replicated']} replicated on several ranks checked on each, replicas compared")
    return ("each rank's file replayed on its own: " + "; ".join(parts or ["no parameter"])
            + ("" if held.get("replicated") else "; no replicas to compare"))


def verify(run, *, rtol: float | None = None, ulps: float | None = None, jobs: int = 1,
           rule_modules=(), progress=None) -> VerifyReport:
    """Replay every recorded step of every optimizer and compare with the recorded result.

    ``run`` is a path or an open ``upd.Run`` or ``Job`` (a distributed job: every rank's file is replayed as it is,
    shard by shard, and replicas several ranks hold whole are checked to agree). ``rtol``/``ulps`` override each
    rule's documented tolerance (finite, >= 0: ValueError otherwise). ``jobs``: processes sharing the parameters
    and their steps, this one and jobs - 1 workers (parallel.py; ``rule_modules``: modules the workers import for
    rules registered outside the run's own rule modules). Raises ``RunFileError`` for an unusable file and
    ``upd.replay.ReplayRuleError`` when a replay rule raises (a bug in the rule). ``progress``: called as
    ``progress(done, total)`` while replaying, in recorded elements (a parameter's size times its rows; a progress bar).
    """
    check_tolerances(rtol, ulps)
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    own = not isinstance(run, (Run, Job))
    if own:
        run = open_run(run)
    try:
        job = run if isinstance(run, Job) else None
        files = job.ranks if job is not None else {None: run}
        replays = {(rank, opt.index): OptimizerReplay.of(file, opt, rtol=rtol, ulps=ulps)
                   for rank, file in files.items() for opt in file.optimizers}
        total = sum(p.numel * p.num_rows for file in files.values() for opt in file.optimizers
                    for p in opt.param_records.values())
        done = [0]

        def replayed(p: ParamRecord) -> None:
            done[0] += p.numel * p.num_rows
            if progress is not None:
                progress(done[0], total)

        found = _parallel(files, replays, jobs, rule_modules, rtol, ulps) if jobs > 1 and not run.live else None
        checks, problems = [], []  # checks: (rank or None, Check)
        per_param: dict[tuple[int, str], tuple[ParamRecord, list]] = {}  # for the precision notes, over ranks
        for rank, file in files.items():
            for opt in file.optimizers:
                replay = replays[(rank, opt.index)]
                if replay.rule is None:
                    problem = (f"optimizer {opt.index} ({opt.class_name}, torch {file.torch_version}) has no replay "
                               f"rule; registered: {', '.join(registered())}")
                    if problem not in problems:
                        problems.append(problem)
                coverage = _coverage(opt)
                if coverage and coverage not in problems:
                    problems.append(coverage)
                computed = optimizer_checks(replay, list(opt.param_records.values()), replayed=replayed) \
                    if found is None else None
                for p in opt.param_records.values():
                    param_found = (found[(file.path, opt.index, p.name)] if found is not None
                                   else computed[p.name])
                    checks += [(rank, check) for check in param_found]
                    per_param.setdefault((opt.index, p.name), (p, []))[1].extend(param_found)
        if job is not None:
            checks += replica_checks(job.ranks, ulps=ulps)
        notes = [note for p, param_found in per_param.values() if (note := _precision_note(p, param_found))]
        columns = CHECK_COLUMNS if job is None else JOB_CHECK_COLUMNS
        table = pd.DataFrame([{RANK: rank, **{c: getattr(check, c) for c in CHECK_COLUMNS}} for rank, check in checks],
                             columns=columns)
        return VerifyReport(path=os.fspath(run.path), checks=table, problems=problems, precision_notes=notes,
                            params_not_optimized=list(run.params_not_optimized), live=run.live,
                            world_size=job.world_size if job is not None else None,
                            parallelism=job.parallelism if job is not None else None,
                            held=_held(job) if job is not None else {})
    finally:
        if own:
            run.close()


def _parallel(files: dict, replays: dict, jobs: int, rule_modules, rtol, ulps) -> dict | None:
    """Every parameter's checks computed by `jobs` processes (this one and jobs - 1 workers), or None when workers
    could not reproduce this process's rules (parallel.py)."""
    rules = [r.rule for r in replays.values() if r.rule is not None]
    modules = parallel.worker_modules(rules, rule_modules)
    if modules is None:
        return None
    units = {}
    for rank, file in files.items():
        for opt in file.optimizers:
            for p in opt.param_records.values():
                units[(file.path, opt.index, p.name, 0, p.num_rows)] = max(1, p.numel) * max(1, p.num_rows)
    if not units:
        return {}
    units = parallel.split_rows(units, jobs)
    runs = {file.path: file for file in files.values()}  # this process replays too
    found = parallel.parallel_checks(checks_in, units, min(jobs, len(units)), modules, runs=runs, rtol=rtol,
                                     ulps=ulps)
    out: dict = {}
    for (path, opt_index, name, _, _), checks in sorted(found.items(), key=lambda kv: kv[0][3]):  # rows in order
        out.setdefault((path, opt_index, name), []).extend(checks)
    return out


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
    # steps a fused optimizer skipped for GradScaler (an inf/NaN gradient), replayed as no change (skipped_steps)
    found_inf_steps: frozenset = frozenset()

    @classmethod
    def of(cls, run: Run, opt: OptimizerRun, *, rtol=None, ulps=None) -> OptimizerReplay:
        return cls(run=run, opt=opt, rule=lookup(opt.class_name, opt.meta.get("mro", ()), run.torch_version),
                   state_recorded="state" in run.options.get("what", schema.WHAT_CHOICES), rtol=rtol, ulps=ulps,
                   found_inf_steps=skipped_steps.skipped_steps(opt))

    def rule_at(self, step: int) -> ReplayRule:
        """The rule that replays optimizer step `step`: the optimizer's, or no change for a skipped step."""
        return skipped_steps.unchanged(self.rule) if step in self.found_inf_steps else self.rule

    def group(self, record: int, index: int) -> dict:
        if record not in self._groups:  # the one place a recorded param group enters the replay: checked here
            groups = []
            for i, g in enumerate(self.opt.hparams(record)):
                try:
                    groups.append(hparams.checked_group(replay_hparams(g)))
                except hparams.BadHyperparameter as exc:
                    raise RunFileError(f"{self.run.path}: optimizer {self.opt.index}: records/hparams[{record}], "
                                       f"param group {i}: {exc}") from None
            self._groups[record] = groups
        groups = self._groups[record]
        if index >= len(groups):
            raise RunFileError(f"{self.run.path}: optimizer {self.opt.index}: records/hparams[{record}] has "
                               f"{len(groups)} param group(s), no group {index}")
        return groups[index]


def checks_in(run, units: list, rtol, ulps, block_elements) -> list:
    """The checks of each (optimizer index, parameter name, first row, end row) of an open run: the parameters
    whose every row is in `units` replayed with the small ones together (optimizer_checks), the others row
    range by row range."""
    found = {}
    for opt_index in dict.fromkeys(unit[0] for unit in units):
        opt = next(o for o in run.optimizers if o.index == opt_index)
        replay = OptimizerReplay.of(run, opt, rtol=rtol, ulps=ulps)
        mine = [unit for unit in units if unit[0] == opt_index]
        whole = [opt.param_records[name] for _, name, lo, hi in mine
                 if lo == 0 and hi == opt.param_records[name].num_rows]
        for name, checks in optimizer_checks(replay, whole, block_elements).items():
            found[(opt_index, name, 0, opt.param_records[name].num_rows)] = checks
        for unit in mine:
            if unit not in found:
                found[unit] = param_checks(replay, opt.param_records[unit[1]], block_elements, range(unit[2], unit[3]))
    return [found[unit] for unit in units]


def param_checks(replay: OptimizerReplay, p: ParamRecord, block_elements: int | None = None,
                 rows: range | None = None) -> list[Check]:
    """Replay every recorded step of one parameter and compare it with the record: the parameter after the step,
    and, when the next step was recorded, the optimizer state and the parameter before it. One Check per row (per
    row of `rows` when given: a share of a long history, as a worker process of ``jobs=`` gets it).

    The history is read and replayed in bounded blocks (blocks.py): memory stays within a few float64 copies of
    ``block_elements`` elements, whatever the parameter's size, unless the rule needs the whole tensor."""
    opt = replay.opt
    block_elements = block_elements or tensor_blocks.BLOCK_ELEMENTS
    rows = range(p.num_rows) if rows is None else rows
    checks = {row: Check(optimizer=opt.index, param=p.name, record=int(p.records[row]),
                         step=int(opt.steps[int(p.records[row])])) for row in rows}
    reason = _not_replayable(replay, p)
    if reason:
        for check in checks.values():
            check.note = reason
        return list(checks.values())
    todo = []
    for row, check in checks.items():
        if not replay.state_recorded and check.step != 0:
            check.note = "optimizer state not recorded (what= excluded 'state')"
        else:
            todo.append(row)
    if not todo:
        return list(checks.values())
    plan = _ReplayPlan.of(replay, p, block_elements)
    results = {row: blocks.RowResult() for row in todo}
    next_rows = {row: _next_row(p, opt, row, checks[row].record) for row in todo}
    if len(plan.blocks) > 1:  # the tolerance needs each row's largest update over all blocks first
        _replay_blocks(replay, p, plan, todo, next_rows, checks, results, compare=False)
    _replay_blocks(replay, p, plan, todo, next_rows, checks, results, compare=True)
    for row in todo:
        _finish(checks[row], results[row], replay)
    return list(checks.values())


def optimizer_checks(replay: OptimizerReplay, params: list, block_elements: int | None = None,
                     replayed=None) -> dict[str, list]:
    """{name: param_checks(replay, p)} for parameters of one optimizer, the small parameters of each param group
    that share their records replayed together as one tensor (batch.py); the others, and every parameter of a
    batch that cannot be replayed as one or whose check mismatches, one by one. replayed(p): called once per
    parameter when its checks are done (verify's progress)."""
    block_elements = block_elements or tensor_blocks.BLOCK_ELEMENTS
    replayed = replayed or (lambda p: None)
    out: dict[str, list] = {}
    for members in _batches(replay, params, block_elements):
        out.update(_batch_checks(replay, members))
        for p, _ in members:
            if p.name in out:
                replayed(p)
    checks = {}
    for p in params:
        if p.name not in out:
            out[p.name] = param_checks(replay, p, block_elements)
            replayed(p)
        checks[p.name] = out[p.name]
    return checks


def _batches(replay: OptimizerReplay, params: list, block_elements: int) -> list[list]:
    """Groups of at least two parameters (with their plans) that batch.replay_row can replay together: small, an
    elementwise rule, state recorded, and the same param group, records, state keys and tolerance."""
    if replay.rule is None or not replay.state_recorded:
        return []
    groups: dict = {}
    for p in params:
        if not 1 < p.numel <= batch.BATCH_ELEMENTS or p.num_rows == 0 or _not_replayable(replay, p):
            continue
        plan = _ReplayPlan.of(replay, p, block_elements)
        if plan.chunk is None:  # the rule needs whole tensors or rows
            continue
        key = (p.param_group or 0, p.records.tobytes(), tuple(plan.state_keys), tuple(sorted(plan.elementwise_keys)),
               (plan.tol.eps, plan.tol.ulps, plan.tol.rtol))
        groups.setdefault(key, []).append((p, plan))
    out = []
    for members in groups.values():  # at most a block's elements per batch and step
        batch_now, size = [], 0
        for member in members:
            if batch_now and size + member[0].numel > block_elements:
                out.append(batch_now)
                batch_now, size = [], 0
            batch_now.append(member)
            size += member[0].numel
        out.append(batch_now)
    return [members for members in out if len(members) > 1]


def _batch_checks(replay: OptimizerReplay, members: list) -> dict[str, list]:
    """{name: checks} of a batch replayed as one; what must be checked one by one is left out (all of it when the
    batch cannot be replayed as one)."""
    opt, path = replay.opt, replay.run.path
    first, plan = members[0]
    names = [p.name for p, _ in members]
    checks = {p.name: [Check(optimizer=opt.index, param=p.name, record=int(r), step=int(opt.steps[int(r)]))
                       for r in p.records] for p, _ in members}
    redo = set()
    # rows read at once: the batch's elements of all of them within a block (tensor_blocks.BLOCK_ELEMENTS), as one by one
    per_read = max(1, plan.block_elements // sum(p.numel for p, _ in members))
    tiles: list = []
    try:
        for row in range(first.num_rows):
            if row % per_read == 0:  # the next rows, and the row after them (the next step's record)
                rows = slice(row, min(row + per_read + 1, first.num_rows))
                tiles = [blocks.Tile(p, rows, (), plan.state_keys, plan.elementwise_keys, path) for p, plan in members]
            record = int(first.records[row])
            step = int(opt.steps[record])
            has_next = _next_row(first, opt, row, record) is not None
            where = f"optimizer {opt.index}, parameters {names[0]!r} and {len(names) - 1} more, step {step}"
            results = batch.replay_row(replay.rule_at(step), tiles, row, has_next, replay.state_recorded,
                                       plan.elementwise_keys,
                                       replay.group(record, first.param_group or 0), step, plan.tol, where, path)
            for name, result in zip(names, results):
                check = checks[name][row]
                _finish(check, result, replay)
                if check.status == "mismatch":  # its explanation comes from the one-by-one path
                    redo.add(name)
    except (batch.Fallback, ReplayRuleError, RunFileError):
        return {}  # each parameter replayed (and its failure reported) on its own
    return {name: found for name, found in checks.items() if name not in redo}


def _not_replayable(replay: OptimizerReplay, p: ParamRecord) -> str | None:
    """Why no step of this parameter can be replayed, or None."""
    rule = replay.rule
    if rule is None:
        return f"no replay rule for {replay.opt.class_name}"
    if holds_part(p.meta):
        # A rank's shard of a distributed parameter replays on its own only under elementwise math.
        if rule.needs_whole_tensor:
            return f"{rule.name} needs the whole tensor; this parameter is a shard"
        if rule.needs_whole_rows and p.meta.get(schema.PART_LAYOUT) == schema.PART_FLAT:
            return f"{rule.name} needs whole rows; this part is a run of the flattened parameter (DeepSpeed, FSDP1)"
        if p.numel == 0:
            return "this rank holds no part of this parameter (an empty shard)"
    missing = [k for k in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER) if k not in p.kinds]
    if missing:
        return f"{', '.join(missing)} not recorded"
    if str(p.dtype or "").startswith("complex"):
        # torch replays complex parameters as (real, imag) pairs; the rules work on real tensors only
        return f"complex parameters ({p.dtype}) are not replayed"
    return None


@dataclass
class _ReplayPlan:
    """How one parameter is cut: its element blocks, the rule's chunk size (None: shaped, one call per block),
    which state entries are cut like the parameter, and the tolerance."""

    blocks: list
    chunk: int | None
    state_keys: list
    elementwise_keys: set
    tol: blocks.Tolerance
    block_elements: int  # rows of a parameter smaller than a block are read together, up to a block

    @classmethod
    def of(cls, replay: OptimizerReplay, p: ParamRecord, block_elements: int) -> _ReplayPlan:
        rule = replay.rule
        state_keys = list(p.state_keys) if replay.state_recorded else []
        shapes = {k: _stored_shape(p, f"{schema.STATE_GROUP}/{k}") for k in state_keys}
        elementwise_keys = {k for k, shape in shapes.items() if shape == tuple(p.shape) and p.numel > 1}
        odd = [k for k, shape in shapes.items()
               if k not in elementwise_keys and shape is not None and math.prod(shape) > 1]
        if rule.needs_whole_tensor or odd:
            cut, chunk = [()], None
        elif rule.needs_whole_rows:
            cut, chunk = tensor_blocks.element_blocks(tuple(p.shape), block_elements, whole_rows=True), None
        else:
            cut, chunk = tensor_blocks.element_blocks(tuple(p.shape), block_elements), blocks.CHUNK_ELEMENTS
        eps = storage_eps(p.storage_dtype(schema.KIND_PARAM_AFTER))
        reduced = eps > _SPACING["float32"]
        ulps = rule.ulps if replay.ulps is None else replay.ulps
        rtol = rule.rtol if replay.rtol is None else replay.rtol
        # Reduced-precision storage rounds the inputs too: the update can only be checked to that precision.
        rtol = max(rtol, 4 * eps) if reduced else rtol
        return cls(blocks=cut, chunk=chunk, state_keys=state_keys, elementwise_keys=elementwise_keys,
                   tol=blocks.Tolerance(eps=eps, ulps=ulps, rtol=rtol), block_elements=block_elements)


def _stored_shape(p: ParamRecord, kind: str) -> tuple | None:
    """The per-row shape of a state entry, None when it has no dataset (a row marking it present is an error the
    reading reports)."""
    try:
        return p.stored_shape(kind)
    except RunFileError:
        return None


def _replay_blocks(replay: OptimizerReplay, p: ParamRecord, plan: _ReplayPlan, todo: list, next_rows: dict,
                   checks: list, results: dict, *, compare: bool) -> None:
    """One pass over the parameter's blocks: each block read a batch of rows at a time and every row in `todo`
    replayed on it. compare=False only gathers each row's scales (first pass of a parameter cut in several
    blocks); compare=True compares too, with the scales gathered (or, for one block, those of the block)."""
    path = replay.run.path
    wanted = set(todo)
    for index in plan.blocks:
        per_tile = max(1, plan.block_elements // max(1, math.prod(tensor_blocks.block_shape(tuple(p.shape), index))))
        for start in range(todo[0], todo[-1] + 1, per_tile):
            rows = [r for r in range(start, min(start + per_tile, p.num_rows)) if r in wanted]
            if not rows:
                continue
            stop = rows[-1] + 1 + (next_rows[rows[-1]] is not None)
            tile = blocks.Tile(p, slice(start, stop), index, plan.state_keys, plan.elementwise_keys, path)
            for row in rows:
                result = results[row]
                if result.skip_note is not None:
                    continue
                _replay_row(replay, p, plan, tile, row, next_rows[row], checks[row], result, compare)


def _replay_row(replay, p, plan, tile, row, nxt, check, result, compare) -> None:
    opt = replay.opt
    i = row - tile.start
    has_next = nxt is not None
    inputs = blocks.RowInputs(before=tile.before[i], grad=tile.grad[i], after=tile.after[i], state=tile.state_at(row),
                              next_before=tile.before[i + 1] if has_next else None,
                              next_state=tile.state_at(row + 1) if has_next and replay.state_recorded else None)
    group = replay.group(check.record, p.param_group or 0)
    where = f"optimizer {opt.index}, parameter {p.name!r}, step {check.step}"
    try:
        replayed_param, replayed_state, scale = blocks.replay_chunks(
            replay.rule_at(check.step), inputs, plan.elementwise_keys, group, check.step, plan.chunk, where,
            replay.run.path)
    except NotReplayable as exc:
        result.skip_note = str(exc)
        return
    if not compare or len(plan.blocks) == 1:  # else the first pass found the scales
        result.scale = max(result.scale, scale)
        blocks.state_scales(result, inputs)
    if not compare:
        return

    def conflict(recorded, replayed_state, flat):
        found = _shape_conflict(recorded, replayed_state, flat=flat)
        return f"{replay.run.path}: {where}: {found} (replay rule {replay.rule.function_name})" if found else None
    before_err = (result.err_to_tol, result.state_err_to_tol)
    blocks.compare_block(result, inputs, replayed_param, replayed_state, plan.tol, plan.chunk, conflict)
    param_bad = result.err_to_tol > 1.0 >= before_err[0]
    state_bad = (result.state_err_to_tol or 0.0) > 1.0 >= (before_err[1] or 0.0)
    if (param_bad or state_bad) and not result.explained:  # the first block that mismatches explains the step
        result.explained = True
        result.explanation = _explain_block(replay, inputs, group, check, plan)


def _explain_block(replay, inputs, group, check, plan) -> str | None:
    """The cause of a mismatch, found by replaying the usual suspects on this block (the whole tensor when it fits
    in one), or None."""
    rule, tol = replay.rule, plan.tol
    shape = inputs.before.shape
    before, grad, after = (_f64(t) for t in (inputs.before, inputs.grad, inputs.after))
    state = {k: _f64(v) for k, v in inputs.state.items()}
    next_state = {k: _f64(v) for k, v in inputs.next_state.items()} if inputs.next_state is not None else None

    def matches(alt_param, alt_state):
        alt_param = alt_param.reshape(shape)
        if compare(alt_param, after, _largest(alt_param - before), eps=tol.eps, ulps=tol.ulps, rtol=tol.rtol)[1] > 1.0:
            return False
        alt_state_ratio = _state_error(next_state, alt_state, tol.eps, tol.ulps, tol.rtol) if next_state else None
        return alt_state_ratio is None or alt_state_ratio <= 1.0

    def replay_with(alt_grad, alt_group):
        return rule.replay(before, alt_grad, {k: v.clone() for k, v in state.items()}, alt_group, check.step)

    return explain(replay_with, before, grad, after, group, next_state, matches)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.double()


# Below this fraction of its moving elements resolved (update larger than the tolerance), a check that passes
# could not have told the recorded update from a missing or doubled one: it is inconclusive, not a match.
MIN_RESOLVED = 0.5


def _finish(check: Check, result: blocks.RowResult, replay: OptimizerReplay) -> None:
    """Turn a row's accumulated result into the check's status and note."""
    if result.skip_note is not None:
        check.note = result.skip_note
        return
    if check.step in replay.found_inf_steps:
        check.note = skipped_steps.NOTE
    check.max_abs_err, check.err_to_tol = result.max_abs_err, result.err_to_tol
    check.update_rel_err = result.max_abs_err / result.recorded_scale if result.recorded_scale > 0 else math.nan
    check.update_resolved = result.resolved / result.moving if result.moving else math.nan
    if result.state_err_to_tol is not None:
        check.state_checked, check.state_err_to_tol = True, result.state_err_to_tol
    param_ok = result.err_to_tol <= 1.0
    state_ok = result.state_err_to_tol is None or result.state_err_to_tol <= 1.0
    if param_ok and state_ok and result.continuous:
        if result.moving and check.update_resolved < MIN_RESOLVED:
            check.status = "inconclusive"
            check.note = (f"the tolerance is larger than the update on {1 - check.update_resolved:.0%} of the "
                          "moving elements: an update missing or wrong on those elements would pass too")
        else:
            check.status = "match"
        return
    check.status = "mismatch"
    if not (param_ok and state_ok):
        what = ("recorded update differs from the replayed one" if not param_ok else
                "next record's optimizer state differs from the replayed state")
        check.note = what + (f": {result.explanation}" if result.explanation else "")
    else:
        check.note = "parameter changed outside the optimizer before the next step"


def _coverage(opt: OptimizerRun) -> str | None:
    """Why most of an optimizer's steps could not be checked, when they could not: only steps with a full record
    (every=) hold the tensors a replay needs; steps with statistics alone (stats_every=) do not."""
    record_steps = {int(s) for s in opt.steps}
    stats_steps = {int(s) for s in opt.committed_stats_steps()}
    seen = record_steps | stats_steps
    if not seen or len(record_steps) == len(seen):
        return None
    name = f"optimizer {opt.index} ({opt.class_name})"
    if not record_steps:
        return (f"{name}: none of its {len(seen)} recorded steps has a full record (statistics only), and statistics "
                "cannot be replayed: record full tensors with every=N to verify")
    return (f"{name}: {len(record_steps)} of its {len(seen)} recorded steps have full records and were checkable; "
            f"the other {len(seen) - len(record_steps)} have statistics only, which cannot be replayed")


def _precision_note(p: ParamRecord, checks: list[Check]) -> str | None:
    """How closely reduced-precision storage let this parameter's updates be checked (median over its steps)."""
    dtype = p.storage_dtype(schema.KIND_PARAM_AFTER)
    if storage_eps(dtype) <= _SPACING["float32"]:
        return None
    resolved = sorted(c.update_resolved for c in checks if c.update_resolved == c.update_resolved)
    if not resolved:
        return None
    median = resolved[len(resolved) // 2]
    return (f"{p.name}: stored as {dtype}, so the tolerance exceeds the update itself on {1 - median:.0%} of the "
            f"elements (median over its steps){'; inconclusive' if median < MIN_RESOLVED else ''}")


def _next_row(p: ParamRecord, opt: OptimizerRun, row: int, record: int) -> int | None:
    """The row of the very next optimizer step for this parameter, if it was recorded."""
    nxt = row + 1
    if nxt >= p.num_rows or int(p.records[nxt]) != record + 1:
        return None
    return nxt if int(opt.steps[record + 1]) == int(opt.steps[record]) + 1 else None


def _shape_conflict(recorded: dict, replayed_state: dict, flat: bool = False) -> str | None:
    """Why the state recorded before the next step cannot be compared with the replayed state, or None. flat: the
    replay ran on the flattened tensor (an elementwise rule), so only the number of elements must agree."""
    for key, value in replayed_state.items():
        if key not in recorded:
            continue
        if flat and recorded[key].numel() == value.numel():
            continue
        if not same_shape(recorded[key], value):
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
