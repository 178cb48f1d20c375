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
from typing import Any, Sequence

from ..alert_rules import AlertRules
from ..runfile import schema

ZERO_COUNT_KINDS = ("param", "grad", "update", "state")
# The smallest stats_sample: below it a sample's std is off by more than a few percent (relative standard error
# ~ 1/sqrt(2K)), no longer a useful estimate of update:data (upd/recorder/sampled_stats.py).
MIN_STATS_SAMPLE = 256
COMPRESSIONS = ("gzip", "lzf")

# The kinds of value an option takes, each one kind of launcher flag (upd/cli/record.py).
STEPS_OR_NEVER, COUNT, FACTOR, GLOBS, CHOICES, CHOICE, LOG_DIR, RANKS, FLAG, PYTHON_ONLY = (
    "steps or never", "count", "factor", "globs", "choices", "choice", "log dir", "ranks", "flag", "python only")


def option(default, help: str, kind: str, stored: bool = False, choices: Sequence[str] = (), metavar: str = ""):
    return dataclasses.field(default=default, metadata={"help": help, "kind": kind, "stored": stored,
                                                        "choices": tuple(choices), "metavar": metavar})


@dataclasses.dataclass(frozen=True)
class RecordOptions:
    """The options of ``upd.record`` (``help(upd.record)`` explains each at length), in the README's order."""

    every: int | None = option(1, "Full tensors every N-th optimizer step ('never': statistics or flight recorder "
                                  "only).", STEPS_OR_NEVER, stored=True)
    stats_every: int | None = option(None, "Summary statistics every N-th step.", STEPS_OR_NEVER, stored=True)
    sinks: Sequence = option((), "Live outputs beside the file (upd.sinks.Sink objects).", PYTHON_ONLY)
    tensorboard: Any = option(None, "Write live update:data and grad:data scalars to this TensorBoard log dir.",
                              LOG_DIR, metavar="DIR")
    include: Any = option(None, "Record only parameters whose name matches (repeatable).", GLOBS, stored=True,
                          metavar="GLOB")
    exclude: Any = option(None, "Skip parameters whose name matches (repeatable).", GLOBS, stored=True,
                          metavar="GLOB")
    what: Sequence[str] = option(schema.WHAT_CHOICES, "What to store per parameter (repeatable; default all three).",
                                 CHOICES, stored=True, choices=schema.WHAT_CHOICES)
    dtype: str = option("keep", "Storage dtype of the full tensors.", CHOICE, stored=True,
                        choices=schema.STORAGE_DTYPES)
    compression: str | None = option(None, "HDF5 compression.", CHOICE, stored=True, choices=COMPRESSIONS)
    zero_counts: Sequence[str] = option(("grad",), "Whose fraction of zeros the statistics count (repeatable; "
                                        "default grad).", CHOICES, stored=True, choices=ZERO_COUNT_KINDS)
    full_stats_every: int | None = option(100, "The full statistics set every N-th step (the lean set otherwise).",
                                          STEPS_OR_NEVER, stored=True)
    stats_sample: int | None = option(None, "Estimate the statistics of each tensor of more than K elements from K "
                                            "of them (default: exact).", COUNT, stored=True, metavar="K")
    flight_recorder: int | None = option(None, "Keep the last K steps in memory; write them on a NaN/Inf or a norm "
                                               "spike.", COUNT, stored=True, metavar="K")
    spike_factor: float = option(10.0, "Flight recorder: a norm this many times its recent median is a spike.",
                                 FACTOR, stored=True)
    alerts: Any = option(False, "Early warnings: check each statistics step live (band, update-norm spike, NaN/Inf); "
                                "True, or an upd.alert_rules.AlertRules.", FLAG, stored=True)
    overwrite: bool = option(False, "Replace RUN and all its files (parts, rank files) first.", FLAG)
    resume: bool = option(False, "Append to RUN (training restarted from a checkpoint).", FLAG)
    strict: bool = option(False, "A recorder error stops the program instead of the recording.", FLAG)
    ranks: Any = option(None, "Distributed jobs: which ranks record.", RANKS)

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


def check_record_options(*, every=1, stats_every=None, full_stats_every=100, flight_recorder=None,
                         spike_factor=10.0, what=schema.WHAT_CHOICES, dtype="keep", compression=None,
                         zero_counts=("grad",), tensorboard=None, overwrite=False, resume=False,
                         stats_sample=None, sinks=(), alerts=False) -> None:
    """Raise ValueError naming the first option upd.record would refuse; the defaults are upd.record's."""
    for label, cadence in (("every", every), ("stats_every", stats_every), ("full_stats_every", full_stats_every)):
        if cadence is not None and (not isinstance(cadence, int) or isinstance(cadence, bool) or cadence < 1):
            raise ValueError(f"{label} must be a positive integer or None, got {cadence!r}")
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
