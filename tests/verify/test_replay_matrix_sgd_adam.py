"""The replay matrix (tests/harness/replay_matrix.py) for the cases of SGD, Adam, AdamW, Adafactor, Muon, SparseAdam and LBFGS: verify passes for every
implementation, and fails on each perturbation of one implementation per option set."""
import pytest

from tests.harness import replay_matrix as matrix
from tests.harness.cases import cases_in

CASES = cases_in("sgd_adam", "adafactor_muon_sparseadam", "lbfgs")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return matrix.recorded_cases(tmp_path_factory)


@pytest.mark.parametrize("case", matrix.passes_params(CASES))
def test_verify_passes(case, recorded):
    matrix.check_verify_passes(case, recorded(case))


@pytest.mark.parametrize("case, kind", matrix.perturbation_params(CASES))
def test_verify_fails_on_perturbation(case, kind, recorded, tmp_path):
    caught, summary = matrix.perturbation_caught(case, recorded(case), kind, tmp_path)
    assert caught, summary


def test_every_case_module_runs_in_one_matrix_file():
    """A new module of cases must be listed by one of the test_replay_matrix_*.py files, or it would never run."""
    import glob
    import importlib
    import os

    from tests.harness.cases import all_cases

    run = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "test_replay_matrix_*.py"))):
        run += [c.id for c in importlib.import_module(f"tests.verify.{os.path.basename(path)[:-3]}").CASES]
    assert sorted(run) == sorted(c.id for c in all_cases())
