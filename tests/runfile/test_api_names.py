"""The reader's naming convention: tables are methods, arrays are plural, counts are num_*."""
import os
import warnings

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
