"""The per-parameter summary, computed in one pass of array slices, against its definition written per parameter
with pandas (what it was before), on a real run with two optimizers, NaN gradients and unordered rows."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

import upd
from upd.analyzer.summary import SUMMARY_COLUMNS, Thresholds, status_of, summarize

from tests.harness.training import MLP


def reference_summary(ratios: pd.DataFrame, params: pd.DataFrame, thresholds: Thresholds) -> pd.DataFrame:
    """The definition, one DataFrame per parameter: rows in record order; median and last of the finite ratios."""
    shapes = {(r.optimizer, r.param): tuple(r.shape) for r in params.itertuples()}
    order = list(dict.fromkeys(zip(params["optimizer"], params["param"])))
    rows = []
    for (opt, name), df in sorted(ratios.groupby(["optimizer", "param"], sort=False),
                                  key=lambda item: order.index(item[0])):
        df = df.sort_values("record", kind="stable")
        finite = {c: df[c][np.isfinite(df[c])] for c in ("update_to_data", "grad_to_data")}
        bad = df[df["grad_nonfinite"] > 0]
        median = float(finite["update_to_data"].median()) if len(finite["update_to_data"]) else math.nan
        shape = shapes[(opt, name)]
        rows.append({
            "optimizer": opt, "param": name, "shape": "x".join(map(str, shape)) or "scalar", "records": len(df),
            "latest_update_to_data": float(finite["update_to_data"].iloc[-1]) if len(finite["update_to_data"])
            else math.nan,
            "median_update_to_data": median,
            "latest_grad_to_data": float(finite["grad_to_data"].iloc[-1]) if len(finite["grad_to_data"])
            else math.nan,
            "median_grad_to_data": float(finite["grad_to_data"].median()) if len(finite["grad_to_data"]) else math.nan,
            "nonfinite_grad_steps": len(bad), "first_nonfinite_step": int(bad["step"].min()) if len(bad) else None,
            "status": status_of(median, shape, thresholds),
        })
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


@pytest.fixture(scope="module")
def ratios_and_params(tmp_path_factory):
    torch.manual_seed(0)
    model = MLP()
    opts = [torch.optim.Adam(model.fc1.parameters(), lr=1e-2), torch.optim.SGD(model.fc2.parameters(), lr=1e-1)]
    path = str(tmp_path_factory.mktemp("summary") / "run.h5")
    g = torch.Generator().manual_seed(0)
    with upd.record(path, model, opts, every=1):
        for step in range(7):
            for opt in opts:
                opt.zero_grad()
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            if step in (2, 5):
                model.fc2.bias.grad[0] = math.nan  # NaN gradient steps, and NaN parameters from then on
            for opt in opts:
                opt.step()
    with upd.open_run(path) as run:
        return run.ratios(), run.params()


def test_summary_is_its_per_parameter_definition(ratios_and_params):
    ratios, params = ratios_and_params
    thresholds = Thresholds(high=-1.0, low=-2.5)
    expected = reference_summary(ratios, params, thresholds)
    assert set(expected["optimizer"]) == {0, 1}
    assert expected.set_index("param").loc["fc2.bias", ["nonfinite_grad_steps", "first_nonfinite_step"]].tolist() \
        == [5, 2]  # the NaN spreads to every gradient after step 2
    pd.testing.assert_frame_equal(summarize(ratios, params, thresholds), expected, check_exact=True)
    # row order does not matter: each parameter's rows are taken in record order
    shuffled = ratios.sample(frac=1.0, random_state=0)
    pd.testing.assert_frame_equal(summarize(shuffled, params, thresholds), expected, check_exact=True)


def test_a_changed_ratio_changes_the_summary(ratios_and_params):
    ratios, params = ratios_and_params
    expected = reference_summary(ratios, params, Thresholds())
    changed = ratios.copy()
    rows = changed[(changed["param"] == "fc1.weight") & np.isfinite(changed["update_to_data"])]
    changed.loc[rows.index[-1], "update_to_data"] += 1.0  # the latest finite one
    with pytest.raises(AssertionError):
        pd.testing.assert_frame_equal(summarize(changed, params), expected, check_exact=True)
    pd.testing.assert_frame_equal(summarize(changed, params), reference_summary(changed, params, Thresholds()),
                                  check_exact=True)
