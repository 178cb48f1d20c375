"""Replay-matrix cases: every module here defines CASES, a list of Case; tests/verify/test_replay_matrix_*.py run
them all (recording each with tests/harness/replay_matrix.py).

A case records a short real training run (a small model, two param groups: weights, and everything else at half
the lr) with one optimizer configuration, then checks that `upd.verify` passes, and that each listed perturbation
of the record makes it fail.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

# Perturbations a case can list (see tests/harness/replay_matrix.py):
#   "update"        the recorded update of one parameter at one step is off by 1%
#   "lr"            the lr recorded for one step is 1% off what the optimizer used
#   "weight_decay"  the recorded weight_decay of one step is set to 0 (needs weight_decay != 0 in the case)
PERTURBATIONS = ("update", "lr", "weight_decay")


@dataclass
class Case:
    id: str
    make: Callable  # (param_groups) -> optimizer
    model: str = "mlp"  # "mlp", "conv" or "attention"
    steps: int = 4
    perturb: tuple = ("update", "lr")
    two_groups: bool = True  # second group: non-weights at half the lr
    closure: bool = False  # optimizer.step(closure) (LBFGS)
    sparse: bool = False  # model with a sparse-gradient embedding (SparseAdam)
    expect_exit: int = 0  # 3 for configurations verify must refuse to judge
    # The implementation (forloop, foreach, fused, ...) when the case is one of several implementations of the same
    # optimizer and options; "" when the configuration has one case. Verify must pass for every implementation,
    # but a perturbation is the same tolerance check whichever implementation recorded the run, so each
    # perturbation runs on one case per `options_id` (tests/harness/replay_matrix.py).
    impl: str = ""
    marks: list = field(default_factory=list)


    @property
    def options_id(self) -> str:
        """The (optimizer, options, model) this case shares with its other implementations."""
        return self.id.replace(f"-{self.impl}", "", 1) if self.impl else self.id


MODULES = tuple(module.name for module in pkgutil.iter_modules(__path__))


def cases_in(*modules: str) -> list[Case]:
    """The cases of some modules here (each test file of the matrix runs a few, so that two workers share it)."""
    return [c for module in modules for c in importlib.import_module(f"{__name__}.{module}").CASES]


def all_cases() -> list[Case]:
    cases = cases_in(*MODULES)
    ids = [c.id for c in cases]
    duplicated = {i for i in ids if ids.count(i) > 1}
    assert not duplicated, f"duplicate case ids: {duplicated}"
    return cases
