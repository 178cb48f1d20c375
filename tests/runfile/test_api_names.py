"""The reader's naming convention: tables are methods, arrays are plural, counts are num_*; the earlier names keep
working for one release with a DeprecationWarning that points at the caller's line."""
import os
import warnings

import numpy as np
import pandas as pd
import pytest

import upd

ADAM = os.path.join(os.path.dirname(__file__), "..", "..", "sample_runs", "adam.h5")


@pytest.fixture
def run():
    with upd.open_run(ADAM) as r:
        yield r


def test_every_table_is_a_method_returning_a_dataframe_without_warnings(run):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tables = {"params": run.params(), "steps": run.steps(), "ratios": run.ratios(), "stats": run.stats(),
                  "dumps": run.dumps()}
    assert all(isinstance(t, pd.DataFrame) for t in tables.values())
    assert tables["params"]["param"].tolist() == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert len(tables["steps"]) == run.optimizers[0].num_records == 20
    assert list(tables["dumps"].columns) == ["optimizer", "reason", "trigger_step", "steps", "wall_time"]


def test_arrays_are_plural_and_counts_are_num(run):
    opt = run.optimizers[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.steps.tolist() == list(range(20))
        assert opt.learning_rates.shape == (20, 1) and len(opt.backward_passes) == len(opt.wall_times) == 20
        p = opt.param_records["fc1.weight"]
        assert p is run.param("fc1.weight") and p.num_rows == len(p.records) == 20


OLD_NAMES = [
    (lambda r: r.params["param"].tolist(), lambda r: r.params()["param"].tolist(), "Run.params"),
    (lambda r: len(r.steps), lambda r: len(r.steps()), "Run.steps"),
    (lambda r: list(r.dumps), lambda r: r.dumps().to_dict("records"), "Run.dumps"),
    (lambda r: list(r.optimizers[0].params), lambda r: list(r.optimizers[0].param_records), "OptimizerRun.params"),
    (lambda r: r.optimizers[0].step.tolist(), lambda r: r.optimizers[0].steps.tolist(), "OptimizerRun.step"),
    (lambda r: r.optimizers[0].lr.tolist(), lambda r: r.optimizers[0].learning_rates.tolist(), "OptimizerRun.lr"),
    (lambda r: r.optimizers[0].backward_pass.tolist(), lambda r: r.optimizers[0].backward_passes.tolist(),
     "OptimizerRun.backward_pass"),
    (lambda r: r.optimizers[0].wall_time.tolist(), lambda r: r.optimizers[0].wall_times.tolist(),
     "OptimizerRun.wall_time"),
    (lambda r: r.param("fc1.weight").rows, lambda r: r.param("fc1.weight").num_rows, "ParamRecord.rows"),
]


@pytest.mark.parametrize("old, new, name", OLD_NAMES, ids=[n for _, _, n in OLD_NAMES])
def test_old_names_still_work_with_a_deprecation_warning_at_the_callers_line(run, old, new, name):
    with pytest.warns(DeprecationWarning, match=name.replace(".", r"\.")) as caught:
        old_value = old(run)
    assert old_value == new(run)
    assert {w.filename for w in caught if issubclass(w.category, DeprecationWarning)} == {__file__}


def test_the_bound_table_is_not_mistaken_for_the_table(run):
    assert "call it" in repr(run.params)
    with pytest.warns(DeprecationWarning):
        assert run.params.shape == run.params().shape
    assert np.array_equal(run.steps()["step"], run.optimizers[0].steps)


def test_a_table_kept_past_close_still_holds_its_rows():
    with upd.open_run(ADAM) as r:
        kept_old, kept_new = r.steps, r.steps()
    assert len(kept_new) == 20
    with pytest.warns(DeprecationWarning):
        assert len(kept_old) == 20
