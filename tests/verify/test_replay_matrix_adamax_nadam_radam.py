"""The replay matrix (tests/harness/replay_matrix.py) for the cases of Adamax, NAdam and RAdam: verify passes for every
implementation, and fails on each perturbation of one implementation per option set."""
import pytest

from tests.harness import replay_matrix as matrix
from tests.harness.cases import cases_in

CASES = cases_in("adamax_nadam_radam")


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
