"""The replay matrix (tests/harness/replay_matrix.py) for the cases of
SGD, Adam, AdamW, Adafactor, Muon, SparseAdam and LBFGS: verify passes for every
implementation, and fails on each perturbation of one implementation per option set."""
from tests.harness import replay_matrix as matrix
from tests.harness.cases import cases_in

CASES = cases_in("sgd_adam", "adafactor_muon_sparseadam", "lbfgs")
recorded, test_verify_passes, test_verify_fails_on_perturbation = matrix.matrix_tests(CASES)


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
