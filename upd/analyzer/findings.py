"""The story of a run in a few ranked lines: what is wrong, where, since when, and the numbers that say so.

Every finding comes from the rules of ``upd.alert_rules`` (the same rules a live checker applies to one step)
applied to a run's whole columns, then gathered per parameter or per step: weights outside the update:data band
and since which step, weights that stopped moving (dead or frozen in practice), update-norm spikes and whether the
loss followed, Adam state anomalies, clipping on most steps, NaN/Inf. Pure functions of the run's tables; rules and
thresholds: docs/diagnosis.md.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from .. import alert_rules as rules_
from ..alert_rules import AlertRules
from .clipping import summarize_clipping
from .summary import is_weight

# A weight's steps out of the band count from the first step after which at least this fraction of them are.
SINCE_FRACTION = 0.9
# A weight whose median is inside the band is still found when its last steps are out of it: at least this share
# of its steps (and MIN_TAIL_STEPS), each SINCE_FRACTION out on one side.
TAIL_SHARE = 0.25
MIN_TAIL_STEPS = 5
# Stopped moving: not moving on at least this fraction of the steps from the first such step to the end.
STOPPED_FRACTION = 0.9
# A loss spike follows an update spike when, within LOSS_WINDOW steps from it, the loss exceeds LOSS_SPIKE_FACTOR
# times its median over the spike_window steps before it.
LOSS_WINDOW = 10
LOSS_SPIKE_FACTOR = 1.5
# Clipping is a finding when it was active on more than this fraction of the measured steps.
CLIPPED_SHARE = 0.5
# How many names a finding's line lists before "and N more".
NAMES_SHOWN = 4

# The finding kinds beside the alert rules' own (upd.alert_rules), and the spike the loss followed (ranked apart).
CLIPPING, REPLICAS, SPIKE_LOSS_FOLLOWED = "clipping", "replicas_diverge", "update_spike_loss"
# The live alerts the recorder stored in the run (upd.record(..., alerts=...), run.events()): one finding per kind.
RECORDED = "recorded_alerts"
# Severity: the rank of a finding (higher first); within a kind, larger numbers first.
SEVERITY = {rules_.NONFINITE: 100, REPLICAS: 95, SPIKE_LOSS_FOLLOWED: 90, rules_.NOT_MOVING: 80,
            rules_.SECOND_MOMENT_COLLAPSE: 70, rules_.EXP_AVG_RATIO: 70, rules_.OUT_OF_BAND: 60,
            rules_.UPDATE_SPIKE: 50, CLIPPING: 40}


@dataclass
class Finding:
    """One line of the diagnosis: kind (an alert kind or "clipping"), the parameters and step it is about, the
    line itself and the numbers behind it (evidence, plain JSON values)."""

    kind: str
    severity: float
    text: str
    params: list = field(default_factory=list)
    step: int | None = None
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def since_index(flags: np.ndarray, fraction: float = SINCE_FRACTION) -> int | None:
    """The first index i from which at least `fraction` of flags[i:] are true and flags[i] is, or None."""
    flags = np.asarray(flags, bool)
    if not flags.any():
        return None
    suffix_true = np.cumsum(flags[::-1])[::-1]
    suffix_len = np.arange(len(flags), 0, -1)
    ok = flags & (suffix_true >= fraction * suffix_len)
    hits = np.flatnonzero(ok)
    return int(hits[0]) if len(hits) else None


def step_columns(ratios: pd.DataFrame, stats: pd.DataFrame | None) -> pd.DataFrame:
    """The columns the rules read, one row per (optimizer, param, step) in step order: the ratio table's, joined
    with the statistics table's zero fractions, NaN/Inf counts and state statistics when the run has them."""
    base = ratios[["optimizer", "param", "step", "lr", "update_to_data", "update_norm", "grad_norm", "param_norm",
                   "grad_nonfinite"]]
    if stats is not None and len(stats):
        extra = [c for c in (rules_.GRAD_ZERO_FRAC, "param_nonfinite", "update_nonfinite", rules_.EXP_AVG_MEAN,
                             rules_.EXP_AVG_STD, rules_.EXP_AVG_SQ_MEAN) if c in stats.columns]
        if extra:
            base = base.merge(stats[["optimizer", "param", "step", *extra]].drop_duplicates(
                ["optimizer", "param", "step"]), on=["optimizer", "param", "step"], how="left")
    return base.sort_values(["optimizer", "param", "step"], kind="stable").reset_index(drop=True)


def loss_series(scalars: pd.DataFrame | None, optimizer: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, loss) of the logged loss of an optimizer (finite values), or None when no loss was logged."""
    if scalars is None or "loss" not in scalars.columns or not len(scalars):
        return None
    rows = scalars[scalars["optimizer"] == optimizer]
    steps, loss = rows["step"].to_numpy(dtype=np.int64), pd.to_numeric(rows["loss"], errors="coerce").to_numpy(float)
    keep = np.isfinite(loss)
    return (steps[keep], loss[keep]) if keep.any() else None


def loss_followed(loss: tuple[np.ndarray, np.ndarray] | None, step: int, window: int) -> dict | None:
    """Whether the loss spiked within LOSS_WINDOW steps from `step`: {"spiked", "factor" (the largest loss in the
    window over the median of the `window` logged values before it), "at" (its step)}; None without a loss or
    without enough loss before the step."""
    if loss is None:
        return None
    steps, values = loss
    before = values[steps < step][-window:]
    after_mask = (steps >= step) & (steps <= step + LOSS_WINDOW)
    if len(before) < 3 or not after_mask.any():
        return None
    median = float(np.median(before))
    if not median > 0:
        return None
    worst = int(np.argmax(values[after_mask]))
    factor = float(values[after_mask][worst]) / median
    return {"spiked": factor > LOSS_SPIKE_FACTOR, "factor": factor, "at": int(steps[after_mask][worst])}


def _param_findings(key, rows: pd.DataFrame, weight: bool, median: float, rules: AlertRules) -> tuple[list, list]:
    """The per-parameter findings of one parameter's rows (step order), and its spikes as (step, name, factor,
    norm, baseline) for the per-step grouping."""
    opt, name = key
    steps = rows["step"].to_numpy(dtype=np.int64)
    values = {c: rows[c].to_numpy() for c in rows.columns}
    out, spikes = [], []
    n = len(steps)

    bad = rules_.nonfinite(values)
    if (bad > 0).any():
        first = int(steps[np.argmax(bad > 0)])
        out.append(Finding(rules_.NONFINITE, SEVERITY[rules_.NONFINITE] + float((bad > 0).sum()) / n,
                           f"{name}: NaN/Inf on {int((bad > 0).sum())}/{n} steps, first at step {first}",
                           [name], first, {"steps": int((bad > 0).sum()), "of": n, "first_step": first}))

    reason = rules_.not_moving(values, rules)
    start = since_index(reason != rules_.MOVING, STOPPED_FRACTION)
    stopped = start is not None and n - start >= min(MIN_TAIL_STEPS, n)
    if stopped:
        tail = reason[start:]
        zero_grad = int(((tail == rules_.GRAD_ZERO) | (tail == rules_.GRAD_MOSTLY_ZERO)).sum())
        zero_update = int((tail == rules_.UPDATE_ZERO).sum())
        since = int(steps[start])
        if zero_grad >= zero_update:
            frac = values.get(rules_.GRAD_ZERO_FRAC)
            measured = frac[start:][np.isfinite(frac[start:])] if frac is not None else np.zeros(0)
            what = (f"gradient zero on {zero_grad}/{n - start} steps" if not len(measured)
                    else f"gradient zero or >= {rules.dead_zero_frac:.0%} zeros on {zero_grad}/{n - start} steps, "
                         f"median zero fraction {float(np.median(measured)):.3f}")
            text = f"{name}: dead since step {since}: {what} (no signal reaches it: a dead ReLU, a detached input)"
            verdict = "dead"
        else:
            text = (f"{name}: frozen in practice since step {since}: update exactly zero on {zero_update}/{n - start}"
                    f" steps while its gradient is not (lr 0 in its group, or the optimizer skips it)")
            verdict = "frozen"
        out.append(Finding(rules_.NOT_MOVING, SEVERITY[rules_.NOT_MOVING], text, [name], since,
                           {"verdict": verdict, "since_step": since, "steps": n - start,
                            "grad_zero_steps": zero_grad, "update_zero_steps": zero_update}))

    if weight and not stopped:
        side = rules_.out_of_band(values, rules)
        for sign, word, bound in ((1, "above", rules.high), (-1, "below", rules.low)):
            start = since_index(side == sign)
            median_out = math.isfinite(median) and (median > rules.high if sign > 0 else median < rules.low)
            tail = start is not None and n - start >= max(MIN_TAIL_STEPS, TAIL_SHARE * n)
            if not median_out and not tail:
                continue
            out_steps = int((side == sign).sum())
            if start is None:  # the median is out, but the run came back in at the end (an lr decay): first step out
                start = int(np.argmax(side == sign))
            since = int(steps[start])
            ratio = values["update_to_data"][start:]
            since_median = float(np.median(ratio[np.isfinite(ratio)]))
            distance = abs(median - bound) if median_out else abs(since_median - bound)
            advice = "lr too high for it, or a badly scaled layer" if sign > 0 else "it barely moves: lr too low"
            out.append(Finding(
                rules_.OUT_OF_BAND, SEVERITY[rules_.OUT_OF_BAND] + min(distance, 9.9),
                f"{name}: update:data {word} {bound:g} since step {since}, on {out_steps}/{n} steps (median "
                f"{median:.2f} over the run" + (f", {since_median:.2f} from step {since}" if start else "")
                + f"; {advice})",
                [name], since, {"side": word, "bound": bound, "since_step": since, "steps_out": out_steps, "of": n,
                                "median_run": median, "median_since": since_median}))
            break

    if weight:
        base = rules_.spike_baselines(values["update_norm"], rules)
        factor = rules_.update_spike(values, base, rules)
        lr = np.asarray(values["lr"], dtype=np.float64)
        for i in np.flatnonzero(factor):
            before = lr[max(0, i - rules.spike_window):i]
            before = before[np.isfinite(before) & (before > 0)]
            lr_factor = float(lr[i] / np.median(before)) if len(before) and np.isfinite(lr[i]) else math.nan
            spikes.append((int(steps[i]), name, float(factor[i]), float(values["update_norm"][i]), float(base[i]),
                           lr_factor))

    state = [(rules_.SECOND_MOMENT_COLLAPSE, rules_.second_moment_collapsed(values, rules)),
             (rules_.EXP_AVG_RATIO, rules_.exp_avg_ratio(values) > rules.exp_avg_ratio_limit)]
    for kind, hits in state:
        hits = np.asarray(hits, bool)
        if hits.any():
            first = int(steps[np.argmax(hits)])
            measured = int(np.isfinite(values.get(rules_.EXP_AVG_SQ_MEAN, np.full(n, np.nan))).sum())
            if kind == rules_.SECOND_MOMENT_COLLAPSE:
                level = float(np.sqrt(np.nanmin(np.maximum(values[rules_.EXP_AVG_SQ_MEAN][hits], 0))))
                text = (f"{name}: Adam's second moment collapsed at step {first}: sqrt(mean exp_avg_sq) {level:.3g} "
                        f"< {rules.second_moment_floor:g} on {int(hits.sum())}/{measured} state-measured steps "
                        "(eps, not the gradient, sets the step size)")
            else:
                level = float(np.nanmax(rules_.exp_avg_ratio(values)[hits]))
                text = (f"{name}: exp_avg / sqrt(exp_avg_sq) up to {level:.3g} (> {rules.exp_avg_ratio_limit:g}, "
                        f"which Adam's own recursions never reach) from step {first}, on {int(hits.sum())}/"
                        f"{measured} state-measured steps")
            out.append(Finding(kind, SEVERITY[kind], text, [name], first,
                               {"first_step": first, "steps": int(hits.sum()), "of": measured, "value": level}))
    return out, spikes


def spike_findings(spikes: list, loss, rules: AlertRules) -> list[Finding]:
    """Update-norm spikes grouped by step: one finding per step, naming its weights, with what the loss did."""
    out = []
    by_step: dict[int, list] = {}
    for spike in spikes:
        by_step.setdefault(spike[0], []).append(spike)
    for step, hits in sorted(by_step.items()):
        hits.sort(key=lambda h: -h[2])
        names = [h[1] for h in hits]
        followed = loss_followed(loss, step, rules.spike_window)
        if followed is None:
            after = "no loss logged to compare" if loss is None else "too little loss logged before it to compare"
        elif followed["spiked"]:
            after = (f"the loss followed: {followed['factor']:.2f}x its median at step {followed['at']}, within "
                     f"{LOSS_WINDOW} steps")
        else:
            after = f"the loss did not spike within {LOSS_WINDOW} steps (at most {followed['factor']:.2f}x its median)"
        top = hits[0]
        lr_factors = [h[5] for h in hits if math.isfinite(h[5])]
        if lr_factors and (max(lr_factors) > 2 or min(lr_factors) < 0.5):  # a schedule or a change by hand
            cause = f"; the lr was {max(lr_factors, key=lambda x: abs(math.log(x))):.3g}x its recent median there"
        else:
            cause = "; the lr did not change" if lr_factors else ""
        kind_key = SPIKE_LOSS_FOLLOWED if followed and followed["spiked"] else rules_.UPDATE_SPIKE
        text = (f"update-norm spike at step {step}: {_names(names)} (up to {top[2]:.0f}x its running median: "
                f"{top[3]:.3g} vs {top[4]:.3g}){cause}; {after}")
        out.append(Finding(rules_.UPDATE_SPIKE, SEVERITY[kind_key] + min(math.log10(top[2]), 9.9), text, names, step,
                           {"weights": [{"param": h[1], "factor": h[2], "update_norm": h[3], "median": h[4],
                                         "lr_factor": h[5]} for h in hits], "loss": followed}))
    return out


def recorded_findings(events: pd.DataFrame) -> list[Finding]:
    """The live alerts stored in the run (run.events()), one finding per alert kind: when it first fired, on which
    parameters, how many times; ranked just below the offline finding of the same kind."""
    out = []
    if not len(events):
        return out
    for kind, rows in events.sort_values(["step", "optimizer"], kind="stable").groupby("kind", sort=False):
        first = rows.iloc[0]
        names = list(dict.fromkeys(rows["param"]))
        at_first = list(dict.fromkeys(rows[rows["step"] == first["step"]]["param"]))
        words = rules_.ALERT_WORDS.get(kind, "an alert of an unknown kind")
        text = (f"live alerts recorded: {kind} ({words}) first at step {int(first['step'])} on {_names(at_first)}; "
                f"{len(rows)} in all, on {len(names)} parameters (run.events())")
        out.append(Finding(RECORDED, SEVERITY.get(kind, 0) - 1 + min(len(rows), 99) / 100, text, names,
                           int(first["step"]),
                           {"alert_kind": str(kind), "events": int(len(rows)), "first_step": int(first["step"]),
                            "steps": sorted({int(s) for s in rows["step"]})[:100]}))
    return out


def clipping_findings(scalars: pd.DataFrame | None) -> list[Finding]:
    """Clipping active on most steps: then the clip threshold, not the lr, sets the step size."""
    if scalars is None or not len(scalars):
        return []
    out = []
    for s in summarize_clipping(scalars):
        if s.measured_steps and s.clipped_steps > CLIPPED_SHARE * s.measured_steps:
            out.append(Finding(CLIPPING, SEVERITY[CLIPPING] + s.clipped_steps / s.measured_steps,
                               s.text() + ": the clip threshold, not the lr, sets the step size", [], None,
                               {"optimizer": s.optimizer, "clipped_steps": s.clipped_steps,
                                "measured_steps": s.measured_steps, "median_norm_backward": s.median_norm_backward,
                                "clipped_to": s.clipped_to, "median_norm_clipped": s.median_norm_clipped,
                                "last_clipped_step": s.last_clipped_step}))
    return out


def find(ratios: pd.DataFrame, params: pd.DataFrame, summary: pd.DataFrame, *, scalars: pd.DataFrame | None = None,
         stats: pd.DataFrame | None = None, rules: AlertRules = AlertRules()) -> list[Finding]:
    """Every finding of a run, most severe first, from its ratio table, parameter table and summary (and its
    logged scalars and statistics table when given)."""
    shapes = {(r.optimizer, r.param): tuple(r.shape) for r in params.itertuples()}
    medians = {(r.optimizer, r.param): r.median_update_to_data for r in summary.itertuples()}
    columns = step_columns(ratios, stats) if len(ratios) else None
    out, spikes_by_opt = [], {}
    if columns is not None:
        for key, rows in columns.groupby(["optimizer", "param"], sort=False):
            key = (int(key[0]), key[1])
            found, spikes = _param_findings(key, rows, is_weight(shapes.get(key, ())),
                                            medians.get(key, math.nan), rules)
            out += found
            spikes_by_opt.setdefault(key[0], []).extend(spikes)
    for opt, spikes in spikes_by_opt.items():
        out += spike_findings(spikes, loss_series(scalars, opt), rules)
    out = group_band_findings(out)
    out += clipping_findings(scalars)
    return sorted(out, key=lambda f: -f.severity)


def group_band_findings(findings: list[Finding]) -> list[Finding]:
    """The out-of-band findings of one side as one line (most distant first), each weight with its own since-step
    and numbers: a 100-weight model whose lr is too high for all of them gets one line, not a hundred."""
    band = {}
    for f in findings:
        if f.kind == rules_.OUT_OF_BAND:
            band.setdefault(f.evidence["side"], []).append(f)
    rest = [f for f in findings if f.kind != rules_.OUT_OF_BAND]
    for side, group in band.items():
        if len(group) == 1:
            rest += group
            continue
        group.sort(key=lambda f: -f.severity)
        e0 = group[0].evidence
        advice = "lr too high for them, or badly scaled layers" if side == "above" else "they barely move: lr too low"
        parts = [f"{f.params[0]} since step {f.step} (median {f.evidence['median_run']:.2f}, out on "
                 f"{f.evidence['steps_out']}/{f.evidence['of']} steps)" for f in group[:NAMES_SHOWN]]
        more = f" and {len(group) - NAMES_SHOWN} more" if len(group) > NAMES_SHOWN else ""
        rest.append(Finding(rules_.OUT_OF_BAND, group[0].severity,
                            f"{len(group)} weights' update:data {side} {e0['bound']:g} ({advice}): "
                            + "; ".join(parts) + more,
                            [f.params[0] for f in group], min(f.step for f in group),
                            {"side": side, "bound": e0["bound"], "weights": [
                                {"param": f.params[0], **{k: v for k, v in f.evidence.items()
                                                          if k not in ("side", "bound")}} for f in group]}))
    return rest


def replica_findings(checks: list) -> list[Finding]:
    """Replicas that diverge, from the replay engine's replica checks ([(rank, Check)]): one finding per rank."""
    by_rank: dict[int, list] = {}
    for rank, check in checks:
        by_rank.setdefault(int(rank), []).append(check)
    out = []
    for rank, found in sorted(by_rank.items()):
        found.sort(key=lambda c: (c.step, c.param))
        first = found[0]
        out.append(Finding(REPLICAS, SEVERITY[REPLICAS],
                           f"replica on rank {rank} diverges: {_names([c.param for c in found])} differ from the "
                           f"reference copy, first at step {first.step} ({first.param}: max abs diff "
                           f"{first.max_abs_err:.3g}); replicated training keeps them bitwise equal",
                           [c.param for c in found], int(first.step),
                           {"rank": rank, "params": [{"param": c.param, "step": int(c.step),
                                                      "max_abs_diff": c.max_abs_err} for c in found]}))
    return out


def healthy_line(summary: pd.DataFrame, ratios: pd.DataFrame, rules: AlertRules = AlertRules()) -> str:
    """The one line a run without findings gets, with the numbers that make it healthy."""
    weights = summary[summary["status"].isin(["ok", "HIGH", "LOW"])]
    steps = ratios["step"].nunique() if len(ratios) else 0
    if not len(weights):
        return f"no finding ({steps} steps; no weight with a finite update:data ratio to judge)"
    lo, hi = weights["median_update_to_data"].min(), weights["median_update_to_data"].max()
    return (f"healthy: no finding over {steps} steps; all {len(weights)} weights' median update:data within "
            f"{rules.low:g}..{rules.high:g} ({lo:.2f} to {hi:.2f}), no spike, nothing stopped, no NaN/Inf")


def format_findings(findings: list[Finding], summary: pd.DataFrame, ratios: pd.DataFrame,
                    rules: AlertRules = AlertRules(), escape=str) -> str:
    """The findings section of `upd analyze`: a numbered line per finding, or the healthy line. escape: applied to
    each finding's text (names are the file's text: the terminal gets upd.safe_text.terminal_safe)."""
    if not findings:
        return "findings: " + healthy_line(summary, ratios, rules)
    lines = [f"findings ({len(findings)}, most severe first):"]
    lines += [f"  {i}. {escape(f.text)}" for i, f in enumerate(findings, 1)]
    return "\n".join(lines)
