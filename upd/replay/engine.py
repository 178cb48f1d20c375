"""The verifier: replay each recorded step with the optimizer's own math and compare with what was recorded.

The engine knows nothing about any optimizer: it reads records, asks ``upd.replay`` for the rule of the recorded
optimizer class, and compares. Tolerances are documented in docs/verify.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pandas as pd
import torch

from ..runfile import encoding, schema
from .registry import NotReplayable, lookup, registered
from .explain import explain
from ..runfile.reader import Run, RunFileError, open_run

# Exit codes of `upd verify` (documented in README and `upd verify --help`).
EXIT_MATCH, EXIT_MISMATCH, EXIT_UNUSABLE, EXIT_NOTHING_VERIFIABLE = 0, 1, 2, 3

CHECK_COLUMNS = ["optimizer", "param", "record", "step", "status", "max_abs_err", "update_rel_err", "err_to_tol",
                 "state_checked", "state_err_to_tol", "note"]

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


def unwrap_hparams(group: dict) -> dict:
    return {k: encoding.hparam_value(v) for k, v in group.items()}


@dataclass
class VerifyReport:
    """Result of ``upd.verify``: ``checks`` has one row per (optimizer, param, record)."""

    path: str
    checks: pd.DataFrame
    problems: list = field(default_factory=list)  # why whole optimizers could not be checked
    precision_notes: list = field(default_factory=list)  # limits set by reduced-precision storage
    params_not_optimized: list = field(default_factory=list)  # model parameters no recorded optimizer holds
    live: bool = False  # the run was being written: these are the records committed when it was opened

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
        """Per parameter: checked/matched/mismatched/skipped counts, worst errors, first mismatching step."""
        rows = []
        for (opt, param), df in self.checks.groupby(["optimizer", "param"], sort=False):
            bad = df[df["status"] == "mismatch"]
            rows.append({
                "optimizer": opt, "param": param, "checked": int((df["status"] != "skipped").sum()),
                "matched": int((df["status"] == "match").sum()), "mismatched": len(bad),
                "skipped": int((df["status"] == "skipped").sum()),
                "max_abs_err": df["max_abs_err"].max(), "update_rel_err": df["update_rel_err"].max(),
                "err_to_tol": df["err_to_tol"].max(), "state_err_to_tol": df["state_err_to_tol"].max(),
                "first_mismatch_step": int(bad["step"].min()) if len(bad) else None,
                "explanation": bad.sort_values("step")["note"].iloc[0] if len(bad) else "",
                "result": "FAIL" if len(bad) else ("ok" if (df["status"] == "match").any() else "skipped"),
            })
        return pd.DataFrame(rows)

    def summary(self) -> str:
        lines = [f"{self.path}: {self.matched} step-parameter checks matched, {self.mismatched} mismatched, "
                 f"{self.skipped} skipped"]
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
                lines.append(f"  MISMATCH {r['param']} step {r['step']}: max abs err {r['max_abs_err']:.3g} "
                             f"({r['err_to_tol']:.3g}x tolerance){'; ' + r['note'] if r['note'] else ''}")
        else:
            skipped = self.checks[self.checks["status"] == "skipped"]["note"].drop_duplicates().head(3)
            lines += [f"  skipped: {n}" for n in skipped]
        return "\n".join(lines)


def verify(run, *, rtol: float | None = None, ulps: float | None = None) -> VerifyReport:
    """Replay every recorded step of every optimizer and compare with the recorded result.

    ``run`` is a path or an open ``upd.Run``. ``rtol``/``ulps`` override each rule's documented tolerance.
    """
    own = not isinstance(run, Run)
    if own:
        run = open_run(run)
    try:
        rows, problems, notes = [], [], []
        for opt in run.optimizers:
            _verify_optimizer(run, opt, rtol, ulps, rows, problems, notes)
        checks = pd.DataFrame(rows, columns=CHECK_COLUMNS)
        return VerifyReport(path=os.fspath(run.path), checks=checks, problems=problems, precision_notes=notes,
                            params_not_optimized=list(run.params_not_optimized), live=run.live)
    finally:
        if own:
            run.close()


def _verify_optimizer(run: Run, opt, rtol, ulps, rows: list, problems: list, notes: list) -> None:
    rule = lookup(opt.class_name, opt.meta.get("mro", ()), run.torch_version)
    state_recorded = "state" in run.options.get("what", schema.WHAT_CHOICES)
    if rule is None:
        reason = (f"optimizer {opt.index} ({opt.class_name}, torch {run.torch_version}) has no replay rule; registered: "
                  f"{', '.join(registered())}")
        problems.append(reason)
    hparams_cache: dict[int, list] = {}

    def group_of(record: int, group: int) -> dict:
        if record not in hparams_cache:
            hparams_cache[record] = [unwrap_hparams(g) for g in opt.hparams(record)]
        if group >= len(hparams_cache[record]):
            raise RunFileError(f"{run.path}: optimizer {opt.index}: records/hparams[{record}] has "
                               f"{len(hparams_cache[record])} param group(s), no group {group}")
        return hparams_cache[record][group]

    for p in opt.param_records.values():
        base = {"optimizer": opt.index, "param": p.name}
        missing = [k for k in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER) if k not in p.kinds]
        eps = storage_eps(p.storage_dtype(schema.KIND_PARAM_AFTER))
        reduced = eps > _SPACING["float32"]
        limits = []
        for row in range(p.num_rows):
            record = int(p.records[row])
            check = dict(base, record=record, step=int(opt.steps[record]), status="skipped", max_abs_err=float("nan"),
                         update_rel_err=float("nan"), err_to_tol=float("nan"), state_checked=False,
                         state_err_to_tol=float("nan"), note="")
            rows.append(check)
            if rule is None:
                check["note"] = f"no replay rule for {opt.class_name}"
                continue
            if missing:
                check["note"] = f"{', '.join(missing)} not recorded"
                continue
            if str(p.dtype or "").startswith("complex"):
                # torch replays complex parameters as (real, imag) pairs; the rules work on real tensors only
                check["note"] = f"complex parameters ({p.dtype}) are not replayed"
                continue
            before = p.read(schema.KIND_PARAM, row).double()
            grad = p.read(schema.KIND_GRAD, row).double()
            after = p.read(schema.KIND_PARAM_AFTER, row).double()
            state = {k: v.double() for k, v in p.state_at(row).items()} if state_recorded else None
            if state is None and int(opt.steps[record]) != 0:
                check["note"] = "optimizer state not recorded (what= excluded 'state')"
                continue
            try:
                replayed = rule.fn(before, grad, state or {}, group_of(record, p.param_group or 0),
                                   int(opt.steps[record]))
            except NotReplayable as exc:
                check["note"] = str(exc)
                continue
            except RunFileError:
                raise
            except Exception as exc:  # the recorded values (from the file) are not what the rule can work with
                raise RunFileError(f"{run.path}: optimizer {opt.index} parameter {p.name!r} step "
                                   f"{int(opt.steps[record])}: replay rule {rule.name} failed on the recorded "
                                   f"values ({type(exc).__name__}: {exc})") from exc
            rule_rtol = (replayed.rtol or rule.rtol) if rtol is None else rtol
            rule_ulps = rule.ulps if ulps is None else ulps
            # Reduced-precision storage rounds the inputs too: the update can only be checked to that precision.
            eff_rtol = max(rule_rtol, 4 * eps) if reduced else rule_rtol
            update = replayed.param - before
            scale = float(update.abs().nan_to_num(posinf=0.0).max()) if update.numel() else 0.0
            abs_err, ratio = compare(replayed.param, after, scale, eps=eps, ulps=rule_ulps, rtol=eff_rtol)
            recorded_scale = float((after - before).abs().nan_to_num(posinf=0.0).max()) if after.numel() else 0.0
            check.update(max_abs_err=abs_err, err_to_tol=ratio,
                         update_rel_err=abs_err / recorded_scale if recorded_scale > 0 else float("nan"))
            if reduced and scale > 0:
                limits.append(float(tolerance(after, scale, eps=eps, ulps=rule_ulps, rtol=eff_rtol).median())
                              / float(update.abs().median().clamp_min(1e-30)))
            nxt = _next_row(p, opt, row, record)
            next_state = None
            continuous = True
            if nxt is not None:
                if state_recorded:
                    next_state = {k: v.double() for k, v in p.state_at(nxt).items()}
                # Nothing but the optimizer should touch a parameter between two consecutive steps.
                continuous = bool((elementwise_error(p.read(schema.KIND_PARAM, nxt).double(), after) == 0).all())
            state_ratio = _state_error(next_state, replayed.state, eps, rule_ulps, eff_rtol) if next_state else None
            if state_ratio is not None:
                check.update(state_checked=True, state_err_to_tol=state_ratio)
            param_ok = ratio <= 1.0
            state_ok = state_ratio is None or state_ratio <= 1.0
            check["status"] = "match" if param_ok and state_ok and continuous else "mismatch"
            if not (param_ok and state_ok):
                def matches(alt_param, alt_state):
                    alt_update = (alt_param - before).abs().nan_to_num(posinf=0.0)
                    alt_scale = float(alt_update.max()) if alt_update.numel() else 0.0
                    if compare(alt_param, after, alt_scale, eps=eps, ulps=rule_ulps, rtol=eff_rtol)[1] > 1.0:
                        return False
                    alt_state_ratio = _state_error(next_state, alt_state, eps, rule_ulps, eff_rtol) \
                        if next_state else None
                    return alt_state_ratio is None or alt_state_ratio <= 1.0

                why = explain(rule.fn, before, grad, after, state or {}, group_of(record, p.param_group or 0),
                              int(opt.steps[record]), next_state, matches)
                what = "recorded update differs from the replayed one" if not param_ok else \
                    "next record's optimizer state differs from the replayed state"
                check["note"] = what + (f": {why}" if why else "")
            elif not continuous:
                check["note"] = "parameter changed outside the optimizer before the next step"
        if limits:
            limits.sort()
            notes.append(f"{p.name}: stored as {p.storage_dtype(schema.KIND_PARAM_AFTER)}, so each element is "
                         f"verified only to about {limits[len(limits) // 2]:.2g}x its own update size")


def _next_row(p, opt, row: int, record: int) -> int | None:
    """The row of the very next optimizer step for this parameter, if it was recorded."""
    nxt = row + 1
    if nxt >= p.num_rows or int(p.records[nxt]) != record + 1 or int(opt.steps[record + 1]) != int(opt.steps[record]) + 1:
        return None
    return nxt


def _state_error(recorded: dict | None, replayed_state: dict, eps, ulps, rtol) -> float | None:
    """Worst error/tolerance of the replayed state against the state recorded at the next step."""
    worst = None
    for key, value in replayed_state.items():
        if key not in recorded:
            continue
        rec = recorded[key].double()
        scale = float(rec.abs().nan_to_num(posinf=0.0).max()) if rec.numel() else 0.0
        _, ratio = compare(value, rec, scale, eps=eps, ulps=ulps, rtol=rtol)
        worst = ratio if worst is None else max(worst, ratio)
    return worst
