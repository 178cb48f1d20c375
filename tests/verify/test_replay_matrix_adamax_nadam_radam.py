"""The replay matrix (tests/harness/replay_matrix.py) for the cases of
Adamax, NAdam and RAdam: verify passes for every
implementation, and fails on each perturbation of one implementation per option set."""
from tests.harness import replay_matrix as matrix
from tests.harness.cases import cases_in

CASES = cases_in("adamax_nadam_radam")
recorded, test_verify_passes, test_verify_fails_on_perturbation = matrix.matrix_tests(CASES)
