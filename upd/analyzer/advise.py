"""Per-layer learning-rate advice: the lr multiplier that would bring each weight's update:data to a target.

For the optimizers whose update is proportional to the lr at given gradients and state (Adam and its family,
sign-based optimizers, SGD with or without momentum, ...), scaling a weight's lr by m scales its update by m,
so its update:data (a log10) moves by log10(m): m = 10 ** (target - measured). That holds over a short horizon,
while the weights' scale (the ratio's denominator) and the gradients have not moved much; after a change, record
again and re-measure. Where the update is not proportional to the lr (Adafactor's relative step, LBFGS's line
search and curvature pairs, Rprop's adapted step sizes) no multiplier is derived, and the advice says why.
Derivation and limits: docs/diagnosis.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..runfile.job import Job
from ..runfile.reader import Run
from ..runfile.opening import open_run
from ..safe_text import WIDE_CELL_CHARS, shorten, terminal_safe, text_table
from .summary import is_weight, model_order_keys

DEFAULT_TARGET = -3.0
ASSUMPTION = ("assumes a short horizon: the update scales with the lr while the weights' scale and the gradients "
              "stay about where they were over the measured steps; record again after changing the lr and re-check")

# Optimizer classes (the last part of the recorded class name) whose update is lr times something that does not
# depend on the lr (given the gradients and the state): the multiplier shifts update:data by exactly log10(m).
PROPORTIONAL = {"SGD": "SGD (with momentum too): update = lr x (gradient or momentum buffer)",
                "Adam": "Adam: update = lr x m/(sqrt(v)+eps)", "AdamW": "AdamW: update = lr x (m/(sqrt(v)+eps) + wd p)",
                "Adamax": "Adamax: update = lr x m/u", "NAdam": "NAdam: update = lr x (Nesterov m)/(sqrt(v)+eps)",
                "RAdam": "RAdam: update = lr x rectified m/sqrt(v)",
                "SparseAdam": "SparseAdam: update = lr x m/sqrt(v)",
                "Adagrad": "Adagrad: update = lr x g/sqrt(sum g^2)", "RMSprop": "RMSprop: update = lr x g/sqrt(v)",
                "Adadelta": "Adadelta: update = lr x delta (its accumulators exclude the lr)",
                "ASGD": "ASGD: update = eta x g, eta = lr/(1 + lambd lr t)^alpha (about lr for small lambd)",
                "Muon": "Muon: update = lr x orthogonalized momentum", "Lion": "Lion: update = lr x sign(...)",
                "SignSGD": "sign-based: update = lr x sign(...)", "Adan": "Adan: update = lr x ...",
                "LAMB": "LAMB: update = lr x trust ratio x Adam direction"}
NOT_PROPORTIONAL = {
    "Adafactor": "Adafactor's relative step: the update is RMS(param) x min(lr, 1/sqrt(step)) x ..., so the lr "
                 "scales it only while it is below 1/sqrt(step); change the lr by hand and re-measure",
    "LBFGS": "LBFGS: the step comes from curvature pairs and a line search, not in proportion to the lr",
    "Rprop": "Rprop: the lr is only the first step size; each element's step then adapts and is clamped by "
             "step_sizes, so the update is not proportional to the lr"}

ADVICE_COLUMNS = ["optimizer", "group", "param", "shape", "steps", "measured", "lr", "multiplier", "advised_lr",
                  "note"]


def optimizer_kind(class_name: str) -> tuple[bool | None, str]:
    """(proportional, why) for a recorded optimizer class: True with the update rule that makes it so, False with
    the reason no multiplier is derived, None for a class not known here."""
    short = str(class_name).rsplit(".", 1)[-1]
    if short in PROPORTIONAL:
        return True, PROPORTIONAL[short]
    if short in NOT_PROPORTIONAL:
        return False, NOT_PROPORTIONAL[short]
    return None, (f"{short}: not known here whether its update is proportional to the lr; no multiplier derived "
                  "(if it is, the multiplier is 10 ** (target - measured))")


def multiplier(target: float, measured: float) -> float:
    """The lr factor that moves a median update:data of `measured` to `target` (both log10) when the update is
    proportional to the lr."""
    return 10.0 ** (target - measured) if math.isfinite(measured) else math.nan


def median_lr(lrs) -> float:
    """The median of the recorded lrs (NaN when none is known)."""
    values = np.asarray(lrs, dtype=np.float64)
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else math.nan


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """'A:B' -> (A, B), either side optional ('100:', ':500'); B inclusive. ValueError on anything else."""
    if text is None:
        return None, None
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"--steps must be A:B (either side may be empty), got {text!r}")
    try:
        lo, hi = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        raise ValueError(f"--steps must be A:B with integer steps, got {text!r}") from None
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"--steps {text}: the end is before the start")
    return lo, hi


@dataclass
class Advice:
    target: float
    steps: tuple  # (first, last) step measured, None: no step in range
    per_param: pd.DataFrame  # ADVICE_COLUMNS, one row per weight, in model order
    per_group: pd.DataFrame  # optimizer, group, weights, measured (median of its weights' medians), lr, multiplier...
    optimizers: dict = field(default_factory=dict)  # {index: {"class", "proportional", "why"}}
    others: dict = field(default_factory=dict)  # {(optimizer, group): ([names not judged], their lr)}
    assumption: str = ASSUMPTION

    def snippet(self, optimizer: int = 0, name_chars: int | None = None) -> str:
        """Param groups to paste into the optimizer's constructor: one group per weight with its advised lr, the
        other parameters (biases, norm scales: not judged) with their group's advised lr. name_chars: names longer
        than this are shortened (the terminal's text: a file's names may be 1 MB; any real name is shorter and
        pastes as it is), and a first line says so."""
        rows = self.per_param[(self.per_param["optimizer"] == optimizer) & self.per_param["advised_lr"].notna()]
        groups = self.per_group[self.per_group["optimizer"] == optimizer]
        lines = ["params = dict(model.named_parameters())", "param_groups = ["]
        shortened = []

        def quoted(name: str) -> str:
            if name_chars is not None and len(name) > name_chars:
                shortened.append(name)
                name = shorten(name, name_chars)
            return json.dumps(name)

        for r in rows.itertuples():
            lines.append(f'    {{"params": [params[{quoted(r.param)}]], "lr": {r.advised_lr:.3g}}},')
        advised = {g.group: g.advised_lr for g in groups.itertuples() if math.isfinite(g.advised_lr)}
        for (opt, group), (names, lr) in sorted(self.others.items()):
            if opt != optimizer or not names:
                continue
            listed = ", ".join(f"params[{quoted(n)}]" for n in names)
            why = "its weights' advice" if group in advised else "unchanged: no weight in it to measure"
            lines.append(f'    {{"params": [{listed}], "lr": {advised.get(group, lr):.3g}}},  # group {group}, not '
                         f"weights: {why}")
        lines.append("]")
        cls = self.optimizers.get(optimizer, {}).get("class", "the optimizer")
        lines.append(f"optimizer = {cls}(param_groups, ...)  # your other options as before")
        if shortened:
            lines.insert(0, f"# {len(shortened)} name(s) over {name_chars} characters shortened here: they match no "
                            "parameter as shown (upd advise --json gives them whole)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        def records(frame):
            return json.loads(frame.to_json(orient="records"))
        return {"target": self.target, "steps": list(self.steps) if self.steps else None,
                "assumption": self.assumption, "optimizers": self.optimizers,
                "per_param": records(self.per_param), "per_group": records(self.per_group),
                "snippets": {str(i): self.snippet(i) for i, o in self.optimizers.items() if o["proportional"]}}


def advise_from_tables(ratios: pd.DataFrame, params: pd.DataFrame, classes: dict, *, target: float = DEFAULT_TARGET,
                       steps: tuple = (None, None)) -> Advice:
    """The advice from a run's ratio table and parameter table. classes: {optimizer index: recorded class name}."""
    lo, hi = steps
    chosen = ratios
    if lo is not None:
        chosen = chosen[chosen["step"] >= lo]
    if hi is not None:
        chosen = chosen[chosen["step"] <= hi]
    kinds = {i: optimizer_kind(c) for i, c in classes.items()}
    shapes = {(r.optimizer, r.param): tuple(r.shape) for r in params.itertuples()}
    group_of = {(r.optimizer, r.param): (int(r.group) if r.group is not None and r.group == r.group else 0)
                for r in params.itertuples()}
    by_key = {k: rows for k, rows in chosen.groupby(["optimizer", "param"], sort=False)}
    rows, others = [], {}
    for key in model_order_keys(params, chosen):
        opt, name = int(key[0]), key[1]
        part = by_key.get(key)
        if part is None:
            continue
        group = group_of.get((opt, name), 0)
        if not is_weight(shapes.get((opt, name), ())):
            names, lr = others.setdefault((opt, group), ([], median_lr(part["lr"])))
            names.append(name)
            continue
        u2d = part["update_to_data"].to_numpy(float)
        finite = u2d[np.isfinite(u2d)]
        measured = float(np.median(finite)) if len(finite) else math.nan
        lr = median_lr(part["lr"])
        proportional, why = kinds.get(opt, (None, "optimizer not recorded"))
        if not proportional:
            m, note = math.nan, why
        elif not len(finite):
            m, note = math.nan, "no finite update:data in these steps (it did not move: see the findings)"
        else:
            m, note = multiplier(target, measured), ""
        shape = "x".join(map(str, shapes.get((opt, name), ())))
        rows.append({"optimizer": opt, "group": group, "param": name, "shape": shape,
                     "steps": len(part), "measured": measured, "lr": lr, "multiplier": m,
                     "advised_lr": lr * m if math.isfinite(m) and math.isfinite(lr) else math.nan, "note": note})
    per_param = pd.DataFrame(rows, columns=ADVICE_COLUMNS)
    group_rows = []
    for (opt, group), part in per_param.groupby(["optimizer", "group"], sort=True):
        finite = part["measured"][np.isfinite(part["measured"])]
        measured = float(np.median(finite)) if len(finite) else math.nan
        lr = median_lr(part["lr"])
        proportional, why = kinds.get(opt, (None, ""))
        m = multiplier(target, measured) if proportional else math.nan
        group_rows.append({"optimizer": int(opt), "group": int(group), "weights": len(part), "measured": measured,
                           "lr": lr, "multiplier": m, "advised_lr": lr * m if math.isfinite(m) else math.nan,
                           "others": others.get((int(opt), int(group)), ([], 0))[0],
                           "note": "" if proportional else why})
    per_group = pd.DataFrame(group_rows, columns=["optimizer", "group", "weights", "measured", "lr", "multiplier",
                                                  "advised_lr", "others", "note"])
    measured_steps = (int(chosen["step"].min()), int(chosen["step"].max())) if len(chosen) else None
    optimizers = {int(i): {"class": str(c), "proportional": kinds[i][0], "why": kinds[i][1]}
                  for i, c in classes.items()}
    return Advice(target=target, steps=measured_steps, per_param=per_param, per_group=per_group, optimizers=optimizers,
                  others=others)


def advise(run, *, target: float = DEFAULT_TARGET, steps: tuple = (None, None)) -> Advice:
    """`upd advise` from Python: run is a path or an open Run or Job."""
    own = not isinstance(run, (Run, Job))
    if own:
        run = open_run(run)
    try:
        classes = {o["index"]: o["class"] for o in run.describe()["optimizers"]}
        return advise_from_tables(run.ratios(), run.params(), classes, target=target, steps=steps)
    finally:
        if own:
            run.close()


def format_advice(advice: Advice) -> str:
    """The terminal text: the per-weight table, the per-group lines, the snippet, the assumption."""
    lines = []
    if advice.steps is None:
        return "no recorded step in the chosen range: nothing to advise"
    lines.append(f"lr advice to bring each weight's median update:data over steps {advice.steps[0]}..{advice.steps[1]}"
                 f" to {advice.target:g}")
    for i, o in advice.optimizers.items():
        lines.append(f"optimizer {i}: {terminal_safe(o['class'])}: " + (
            f"update proportional to the lr ({o['why']}): multiplier = 10 ** (target - measured)"
            if o["proportional"] else terminal_safe(o["why"])))
    shown = advice.per_param.drop(columns=["optimizer"]) if advice.per_param["optimizer"].nunique() <= 1 \
        else advice.per_param
    shown = shown.assign(note=shown["note"].map(lambda s: "" if not s else "see above"))
    # every cell terminal_safe and bounded, names shortened to fit (text_table): a row costs what any row costs,
    # never the longest name; every column kept (advise has no --wide)
    lines += ["", text_table(shown, formats={c: "{:.3g}".format for c in ("measured", "lr", "multiplier",
                                                                          "advised_lr")},
                             keep=list(shown.columns))]
    lines.append("")
    for g in advice.per_group.itertuples():
        if math.isfinite(g.multiplier):
            lines.append(f"optimizer {g.optimizer} group {g.group}: {g.weights} weights, median {g.measured:.2f}: "
                         f"lr {g.lr:.3g} x {g.multiplier:.3g} = {g.advised_lr:.3g}")
    for i, o in advice.optimizers.items():
        if o["proportional"] and (advice.per_param["optimizer"] == i).any():
            lines += ["", f"param groups for optimizer {i} (paste into its constructor):",
                      *map(terminal_safe, advice.snippet(i, WIDE_CELL_CHARS).splitlines())]
    lines += ["", "lr: the median over the measured steps (with a schedule, scale the schedule by the multiplier)",
              "note: " + advice.assumption]
    return "\n".join(lines)
