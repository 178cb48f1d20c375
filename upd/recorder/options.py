"""``upd.record``'s options, declared once: ``RecordOptions``, in a module that imports no torch.

Each field is one option: its name, default and type, and in its metadata the one-line help and the kind of value
(``kind``) from which the ``upd record`` launcher makes its flag (``upd/cli/record.py``), and whether the run's
metadata stores it (``stored``). ``RecordOptions(...)`` checks the values (ValueError naming the first option
upd.record would refuse); ``upd.record``'s and ``Recorder``'s signatures are made from the fields
(``record_signature``). The launcher makes the same checks before it starts the user's command, so that a bad option
is refused with the recorder's own message in a process that never needs torch (importing it costs seconds on a
small machine, and the command imports it again anyway).
"""
from __future__ import annotations

import dataclasses
import inspect
import textwrap
from typing import Any, Sequence

from ..alert_rules import AlertRules
from ..runfile import schema
from .cadence import AUTO

ZERO_COUNT_KINDS = ("param", "grad", "update", "state")
# The smallest stats_sample: below it a sample's std is off by more than a few percent (relative standard error
# ~ 1/sqrt(2K)), no longer a useful estimate of update:data (upd/recorder/sampled_stats.py).
MIN_STATS_SAMPLE = 256
COMPRESSIONS = ("gzip", "lzf")

# The kinds of value an option takes, each one kind of launcher flag (upd/cli/record.py).
STEPS_OR_NEVER, COUNT, FACTOR, GLOBS, CHOICES, CHOICE, LOG_DIR, RANKS, FLAG, PYTHON_ONLY = (
    "steps or never", "count", "factor", "globs", "choices", "choice", "log dir", "ranks", "flag", "python only")


def option(default, help: str, kind: str, stored: bool = False, choices: Sequence[str] = (), metavar: str = "",
           doc: str = "", doc_names: str = ""):
    """One option: `help` is its launcher flag's line, `doc` its entry in ``help(upd.record)`` (`doc_names` when the
    entry documents several options at once, e.g. "include / exclude"; an option without `doc` is one of those)."""
    return dataclasses.field(default=default, metadata={"help": help, "kind": kind, "stored": stored,
                                                        "choices": tuple(choices), "metavar": metavar, "doc": doc,
                                                        "doc_names": doc_names})


@dataclasses.dataclass(frozen=True)
class RecordOptions:
    """The options of ``upd.record`` (``help(upd.record)`` explains each at length), in the README's order."""

    every: int | str | None = option(AUTO, "Full tensors every N-th optimizer step ('auto': the first 2 steps, then "
                                           "every 100 or more steps, as the model's size allows; 'never': statistics "
                                           "or flight recorder only).", STEPS_OR_NEVER, stored=True,
        doc=('write the full tensors (parameter before and after, gradient, optimizer state) every N-th optimizer step.'
            ' Default ``"auto"``: at the first two steps (both verifiable: one from fresh optimizer state, one with '
            'state) and then every 100th step, or every 200th, 500th, ... when that keeps full records under 1 GB '
            'per 1,000 steps (each optimizer by the size of its own records; docs/performance.md, "Default '
            'cadence"), with statistics at every step. ``1``: every step (a full record stores each parameter about '
            'five times); an explicit cadence whose full records would exceed 1 GB per 1,000 steps warns once with '
            'the projected size and the cadence that fits. ``None``: never, e.g. with ``stats_every``.'))
    stats_every: int | None = option(None, "Summary statistics every N-th step (default: every step with --every auto "
                                           "or live outputs, else never).", STEPS_OR_NEVER, stored=True,
        doc=('write summary statistics (mean, std, norm, abs max, zeros, NaN/Inf count of each parameter, gradient, '
            'update and state tensor; update:data and grad:data) every N-th step, computed on the training device '
            'with one host copy per step (default None: 1 with ``every="auto"``, live sinks or alerts, else never).'))
    sinks: Sequence = option((), "Live outputs beside the file (upd.sinks.Sink objects).", PYTHON_ONLY,
        doc=('live outputs beside the file, objects with ``write(steps)`` and ``close()`` (``upd.sinks.Sink``; '
            "``upd.sinks.TensorBoard``, or your own): each gets every statistics step's per-parameter statistics and "
            "the logged scalars, together, as ``upd.sinks.SinkStep``s, on the run file's writer thread (never the "
            'training thread), and is closed with the recorder (``stats_every`` defaults to 1 then). A sink that '
            'raises is warned about once and dropped; training and the file go on. In a distributed job rank 0 alone '
            "feeds its sinks, the whole parameters' values (the other ranks' sinks are closed unused). Where each "
            'rank holds a part of the model (FSDP2, ZeroRedundancyOptimizer), every rank joins one all-reduce of a '
            "small float64 tensor per statistics step (15 numbers per parameter and one per rank), in the optimizer's"
            ' post-step hook; replicated training (DDP) needs none. Every rank must then make the same call, with '
            'sinks, the same ``stats_every``, and close its recorder at the same point. A recorder error on one rank '
            'stops the live values on every rank at the next statistics step, never the training. Refused for a '
            "sharded job recorded on one rank only (``ranks=`` an int): its shards' ratios are not the parameters'."))
    tensorboard: Any = option(None, "Write live update:data and grad:data scalars to this TensorBoard log dir.",
                              LOG_DIR, metavar="DIR",
        doc=('a ``torch.utils.tensorboard.SummaryWriter`` or a log dir: shorthand for '
            '``sinks=[upd.sinks.TensorBoard(tensorboard)]`` (made on the writing rank only): '
            '``update_to_data/<param>``, ``grad_to_data/<param>``, the update, gradient and parameter norms and '
            '``scalars/<name>``, live.'))
    include: Any = option(None, "Record only parameters whose name matches (repeatable).", GLOBS, stored=True,
                          metavar="GLOB",
        doc_names="include / exclude",
        doc=('glob pattern(s) on parameter names, e.g. ``include="*.weight"`` (default None: every parameter). '
            'Patterns that match no parameter warn at this call.'))
    exclude: Any = option(None, "Skip parameters whose name matches (repeatable).", GLOBS, stored=True,
                          metavar="GLOB")
    what: Sequence[str] = option(schema.WHAT_CHOICES, "What to store per parameter (repeatable; default all three).",
                                 CHOICES, stored=True, choices=schema.WHAT_CHOICES,
        doc=('subset of ``("param", "grad", "state")`` to store (default all three).'))
    dtype: str = option("keep", "Storage dtype of the full tensors.", CHOICE, stored=True,
                        choices=schema.STORAGE_DTYPES,
        doc=('storage dtype: ``"keep"`` (default, exact), ``"float32"``, ``"float16"`` or ``"bfloat16"``. Smaller '
            'storage limits what ``upd verify`` can prove; its report says by how much.'))
    compression: str | None = option(None, "HDF5 compression.", CHOICE, stored=True, choices=COMPRESSIONS,
        doc=('``None`` (default: float32 weights barely compress and it costs 2.5-35x write time), ``"lzf"`` or '
            '``"gzip"``.'))
    zero_counts: Sequence[str] = option(("grad",), "Whose fraction of zeros the statistics count (repeatable; "
                                        "default grad).", CHOICES, stored=True, choices=ZERO_COUNT_KINDS,
        doc=('whose fraction of exact zeros the statistics count: any of "param", "grad", "update", "state" (default: '
            'gradients only; counting is the slowest statistic on CPU, 4x a sum). Zero fractions belong to the full '
            'statistics set (``full_stats_every``).'))
    full_stats_every: int | None = option(100, "The full statistics set every N-th step (the lean set otherwise).",
                                          STEPS_OR_NEVER, stored=True,
        doc=('statistics steps compute the lean set by default: mean, std, norm and NaN/Inf count of every parameter, '
            'its gradient and its update, so update:data and grad:data (two reductions per tensor, cheaper than a '
            'hand-written clone-and-std() loop). Every ``full_stats_every``-th step (default 100; a multiple of '
            '``stats_every``, or the two rarely coincide) that is a statistics step computes the full set instead: '
            'also abs max, fractions of zeros (``zero_counts``) and the statistics of every optimizer-state tensor. '
            '``1``: the full set at every statistics step; ``None``: never. Statistics at a step with full tensors '
            '(``every=``) are always the full set.'))
    stats_sample: int | None = option(None, "Estimate the statistics of each tensor of more than K elements from K "
                                            "of them (default: exact).", COUNT, stored=True, metavar="K",
        doc=('``None`` (default): exact statistics. An int K >= 256 (4096 recommended): at lean statistics steps, the '
            "mean, std and norm of each parameter and update of more than K elements, and its gradient's mean, are "
            "estimated from K fixed element positions (the gradient's norm, its NaN/Inf count and, nearly, its std "
            "stay exact), so a step's cost no longer grows with the tensors; smaller tensors and full-set steps stay "
            "exact. The run's options record K; the error on real runs is in docs/performance.md. For models where "
            'even the exact lean set is too slow; single-process runs (a distributed job records the exact set, and '
            'its options say stats_sample=None).'))
    flight_recorder: int | None = option(None, "Keep the last K steps in memory; write them on a NaN/Inf or a norm "
                                               "spike.", COUNT, stored=True, metavar="K",
        doc_names="flight_recorder / spike_factor",
        doc=("the flight recorder, one option and its trigger (``flight_recorder=K, spike_factor=F``): keep the last "
             "K steps' full tensors in memory (no disk I/O while nothing happens) and write them to the run when a "
             "trigger fires: a NaN/Inf in a gradient or update, a gradient- or update-norm spike above F (default "
             "10; must be > 1) times its recent median, or ``rec.dump(reason)``. The reasons are stored "
             "(``Run.dumps``); the dumped steps replay and verify like any others. ``spike_factor`` means nothing "
             "without ``flight_recorder``."))
    spike_factor: float = option(10.0, "Flight recorder: a norm this many times its recent median is a spike.",
                                 FACTOR, stored=True)
    alerts: Any = option(False, "Early warnings: check each statistics step live (band, update-norm spike, NaN/Inf); "
                                "True, or an upd.alert_rules.AlertRules.", FLAG, stored=True,
        doc=('early warnings (``True``, or an ``upd.alert_rules.AlertRules`` with other thresholds): each statistics '
             'step is checked on the writer thread, from the values already on the host, for a weight leaving the '
             'update:data band, an update-norm spike, NaN/Inf (and the other rules of docs/diagnosis.md). A new alert '
             'is an ``upd.TrainingAlert`` warning (rate-limited: once per kind and weight, at most 10, then one saying '
             'the rest are stored), an entry of the run\'s events (``Run.events``), ``alerts/<kind>`` counts in every '
             'sink, and with ``flight_recorder=K`` a NaN/Inf or spike alert dumps the kept steps. Implies statistics '
             'at every step unless ``stats_every`` says.'))
    overwrite: bool = option(False, "Replace RUN and all its files (parts, rank files) first.", FLAG,
        doc=('replace an existing file.'))
    resume: bool = option(False, "Append to RUN (training restarted from a checkpoint).", FLAG,
        doc=('append to an existing run (training restarted from a checkpoint): step numbers continue from the '
            "optimizer's own step counter (or after the last recorded step for optimizers without one); a different "
            'optimizer class, parameter set or shape is an error. Without an existing file, starts a new run.'))
    strict: bool = option(False, "A recorder error stops the program instead of the recording.", FLAG,
        doc=('raise recorder errors (at setup too) instead of warning once and stopping recording.'))
    ranks: Any = option(None, "Distributed jobs: which ranks record.", RANKS,
        doc=('which ranks of a distributed job record (ignored in a single process). ``None`` (default): every rank '
            'when each holds a part of the model (FSDP2 shards, ZeroRedundancyOptimizer partitions), rank 0 alone '
            'otherwise (DDP and other replicated training: the replicas are identical), into `path` itself. '
            '``"all"``: every rank, one file each (``upd verify`` then also checks that the replicas agree). An int: '
            'that rank only. Other ranks get an inactive recorder (``rec.active`` is False): no file, no hooks. With '
            '``resume=True`` each rank resumes its own file; the job must have the same number of processes.'))

    def __post_init__(self):
        check_record_options(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                if f.name not in ("include", "exclude", "strict", "ranks")})
        # One spelling each: a string stands for a tuple of one.
        for name in ("what", "zero_counts"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        object.__setattr__(self, "sinks", tuple(self.sinks or ()))
        object.__setattr__(self, "alerts", alert_rules_of(self.alerts))

    @classmethod
    def of_call(cls, options: dict) -> "RecordOptions":
        """The options of an ``upd.record(...)`` call; TypeError naming an option that does not exist."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [name for name in options if name not in known]
        if unknown:
            raise TypeError(f"upd.record() got an unexpected keyword argument {unknown[0]!r} (its options: "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))})")
        return cls(**options)

    def live(self) -> bool:
        """Live sinks are fed (sinks= or tensorboard=) or alerts checked: statistics at every step unless
        stats_every says."""
        return bool(self.sinks) or self.tensorboard is not None or self.alerts_on()

    def alerts_on(self) -> bool:
        return self.alerts is not None

    def stored(self, **as_recorded) -> dict:
        """The run metadata's ``options``: the stored options, in declaration order, with the values the recorder
        records with (``as_recorded``: e.g. include= as its patterns, stats_sample=None in a job)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata["stored"]:
                value = as_recorded.get(f.name, getattr(self, f.name))
                if dataclasses.is_dataclass(value):  # alerts=: the rules' thresholds
                    value = dataclasses.asdict(value)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def alert_rules_of(value) -> AlertRules | None:
    """The rules an ``alerts=`` value asks for: None (off) for False or None, the default rules for True, or the
    AlertRules given; ValueError for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return AlertRules()
    if isinstance(value, AlertRules):
        return value
    raise ValueError(f"alerts= takes True, False or an upd.alert_rules.AlertRules, got {value!r}")


def fields() -> tuple:
    """The options' dataclass fields, in declaration order (the launcher's flags, the README's list)."""
    return dataclasses.fields(RecordOptions)


def record_signature(*leading: inspect.Parameter) -> inspect.Signature:
    """`leading` parameters, then every option as a keyword-only parameter with its default: what help() and
    inspect show for ``upd.record`` and ``Recorder``."""
    return inspect.Signature([*leading, *(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                                            default=f.default, annotation=f.type)
                                          for f in fields())])


def check_record_options(*, every=AUTO, stats_every=None, full_stats_every=100, flight_recorder=None,
                         spike_factor=10.0, what=schema.WHAT_CHOICES, dtype="keep", compression=None,
                         zero_counts=("grad",), tensorboard=None, overwrite=False, resume=False,
                         stats_sample=None, sinks=(), alerts=False) -> None:
    """Raise ValueError naming the first option upd.record would refuse; the defaults are upd.record's."""
    if not (isinstance(every, str) and every == AUTO):
        check_cadence("every", every, also=f', or "{AUTO}"')
    check_cadence("stats_every", stats_every)
    check_cadence("full_stats_every", full_stats_every)
    if stats_sample is not None and (not isinstance(stats_sample, int) or isinstance(stats_sample, bool)
                                     or stats_sample < MIN_STATS_SAMPLE):
        raise ValueError(f"stats_sample must be a number of elements >= {MIN_STATS_SAMPLE} or None (exact "
                         f"statistics), got {stats_sample!r}")
    if flight_recorder is not None and (not isinstance(flight_recorder, int) or flight_recorder < 1):
        raise ValueError(f"flight_recorder must be a positive number of steps or None, got {flight_recorder!r}")
    if not spike_factor > 1:
        raise ValueError(f"spike_factor must be > 1, got {spike_factor!r}")
    alert_rules_of(alerts)  # ValueError for a value alerts= does not take
    if every is None and stats_every is None and tensorboard is None and not sinks and flight_recorder is None \
            and alerts in (None, False):
        raise ValueError("every=None and stats_every=None would record nothing")  # live sinks and alerts imply stats
    unknown = set((what,) if isinstance(what, str) else what) - set(schema.WHAT_CHOICES)
    if unknown:
        raise ValueError(f"what= accepts {schema.WHAT_CHOICES}, got {sorted(unknown)}")
    if dtype not in schema.STORAGE_DTYPES:
        raise ValueError(f"dtype= must be one of {schema.STORAGE_DTYPES}, got {dtype!r}")
    if compression not in (None, *COMPRESSIONS):
        raise ValueError(f"compression= must be None, 'gzip' or 'lzf', got {compression!r}")
    if set((zero_counts,) if isinstance(zero_counts, str) else zero_counts) - set(ZERO_COUNT_KINDS):
        raise ValueError(f"zero_counts= takes 'param', 'grad', 'update', 'state'; got {zero_counts!r}")
    if overwrite and resume:
        raise ValueError("pass overwrite=True or resume=True, not both")


def check_cadence(label: str, cadence, also: str = "") -> None:
    if cadence is not None and (not isinstance(cadence, int) or isinstance(cadence, bool) or cadence < 1):
        raise ValueError(f"{label} must be a positive integer or None{also}, got {cadence!r}")


def documented_options(indent: int = 8, width: int = 116) -> str:
    """Every option's entry of ``help(upd.record)``, in declaration order: "name: doc", wrapped to `width`, the
    entries at `indent` and their continuation lines four further in (a docstring's Args section)."""
    entries = []
    for f in fields():
        if f.metadata["doc"]:
            entries.append(textwrap.fill(f"{f.metadata['doc_names'] or f.name}: {f.metadata['doc']}", width,
                                         initial_indent=" " * indent, subsequent_indent=" " * (indent + 4),
                                         break_on_hyphens=False, break_long_words=False))
    return "\n".join(entries)
