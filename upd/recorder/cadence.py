"""Which steps get full records by default, and what full records cost: pure arithmetic on sizes, no torch.

Statistics every step are cheap (a few KB a step on a 124M-parameter model); full tensors are not: a full record of
an Adam-family optimizer stores each parameter five times (before, gradient, after, the two moments:
5 float32 numbers a parameter, ``full_record_bytes``), 120 MB on a 6M-parameter model and 2.5 GB on a 124M one. So
by default a run records statistics at every step and full tensors at the first ``FIRST_FULL_STEPS`` steps (a step
from fresh state and one with state: both verifiable) and then at the sparsest cadence of ``CADENCES`` at or above
``DEFAULT_EVERY`` that keeps full records within ``BUDGET_BYTES`` per 1,000 steps (``default_every``). A recording
whose full records would take more than that (an explicit ``every=``) warns once with the projected size and the
cadence that fits (``size_warning``). Figures for real models: docs/performance.md, "Default cadence".
"""
from __future__ import annotations

AUTO = "auto"  # every='s default: full records at the first steps, then at the cadence default_every picks
FIRST_FULL_STEPS = 2  # steps 0 and 1: a first step (no optimizer state yet) and one with state, both verifiable
DEFAULT_EVERY = 100  # the densest default cadence of full records
BUDGET_BYTES = 10**9  # full-record bytes per 1,000 steps above which a recording warns (and the default thins out)
CADENCES = (100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000)  # round numbers the default picks from

# Tensors of optimizer state per parameter tensor, as large as it, by optimizer class (the moments: Adam's exp_avg
# and exp_avg_sq); an optimizer not listed counts as 2, the most any torch.optim one keeps. Scalar state (step
# counters) is negligible. Used before the first step, when the optimizer holds no state yet.
STATE_TENSORS = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                 "Adadelta": 2, "RMSprop": 1, "Rprop": 2, "ASGD": 1, "LBFGS": 0, "SparseAdam": 2, "Adafactor": 1,
                 "Muon": 1}
TENSOR_KINDS = 3  # param (before the step), grad, param_after


def state_tensors(class_name: str) -> int:
    """Full-size state tensors per parameter of an optimizer class (its name without the module)."""
    return STATE_TENSORS.get(class_name.rsplit(".", 1)[-1], 2)


def full_record_bytes(param_bytes: int, state_per_param: int, kinds: int = TENSOR_KINDS) -> int:
    """Bytes one full record stores: each recorded parameter's `kinds` tensors (``what=``: param, grad and
    param_after for "param" and "grad") plus its state tensors, `param_bytes` being the recorded parameters' bytes in
    the storage dtype (``dtype=``)."""
    return int(param_bytes) * (kinds + state_per_param)


def bytes_per_1000_steps(record_bytes: int, every: int | None) -> float:
    """Full-record bytes per 1,000 steps at a cadence of one record every `every` steps (None: none)."""
    return 0.0 if every is None else record_bytes * 1000 / every


def default_every(record_bytes: int) -> int:
    """The default cadence of full records: the first of CADENCES (from DEFAULT_EVERY) whose full records stay
    within BUDGET_BYTES per 1,000 steps; the last one for models larger still."""
    for every in CADENCES:
        if every >= DEFAULT_EVERY and bytes_per_1000_steps(record_bytes, every) <= BUDGET_BYTES:
            return every
    return CADENCES[-1]


def full_record_cadence(every, record_bytes: int) -> tuple[int | None, int]:
    """(every, first) for is_full_step: ``every=AUTO`` picks the cadence from one full record's bytes and records the
    first FIRST_FULL_STEPS steps too; an explicit cadence (or None) is taken as given, without first steps."""
    if every == AUTO:
        return default_every(record_bytes), FIRST_FULL_STEPS
    return every, 0


def is_full_step(step: int, every: int | None, first: int = FIRST_FULL_STEPS) -> bool:
    """Whether optimizer step `step` (0-based) gets a full record: one of the first `first` steps, or a multiple of
    `every` (None: only the first steps)."""
    return step < first or (every is not None and step % every == 0)


def size_text(nbytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} bytes"


def size_warning(record_bytes: int, every: int | None) -> str | None:
    """The one warning of a recording whose full records would exceed BUDGET_BYTES per 1,000 steps: the projected
    size and the options that shrink it; None within the budget, and for AUTO (which picks a cadence within it)."""
    if every == AUTO:
        return None
    per_1000 = bytes_per_1000_steps(record_bytes, every)
    if per_1000 <= BUDGET_BYTES:
        return None
    fits = default_every(record_bytes)
    return (f"full records every {every} step(s) will take about {size_text(per_1000)} per 1,000 steps "
            f"({size_text(record_bytes)} each); every={fits} keeps them under {size_text(BUDGET_BYTES)} (statistics "
            f"at every step stay cheap: stats_every=1), and dtype=\"bfloat16\" halves float32 tensors")
