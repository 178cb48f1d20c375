"""Comparing real runs: good init vs bad init (the demo's), lr A vs lr B, and runs that do not share every weight."""
import numpy as np
import pandas as pd
import pytest

import upd
from upd.analyzer import plots
from upd.analyzer.compare import compare, format_comparison, median_table, run_labels
from upd.demo import makemore

from tests.harness.analysis_runs import record_deep


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inits")
    return [makemore.train(folder / f"{init}.h5", init=init, steps=12, n_layers=2, n_hidden=16, log=None)["path"]
            for init in ("good", "bad")]


@pytest.mark.slow
def test_good_init_vs_bad_init_side_by_side(demo_runs, tmp_path):
    result = compare(demo_runs, out_dir=tmp_path / "cmp")
    assert result.labels == ["good", "bad"]
    table = result.table()
    assert list(table.columns) == ["optimizer", "param", "shape", "good", "bad", "bad - good"]
    assert list(table["param"]) == ["emb.weight", "layers.0.weight", "layers.3.weight", "layers.6.weight"]  # model order
    rows = table.set_index("param")
    # Each column is that run's own summary median; the difference is their difference.
    for label, path in zip(result.labels, demo_runs):
        own = upd.analyze(path).summary.set_index("param")["median_update_to_data"]
        pd.testing.assert_series_equal(rows[label], own[rows.index], check_names=False)
    np.testing.assert_allclose(rows["bad - good"], rows["bad"] - rows["good"])
    # The bad init's hidden weights (0.01 * randn under BatchNorm) move orders of magnitude more per step.
    assert (rows.loc[["layers.0.weight", "layers.3.weight"], "bad - good"] > 1).all()
    assert abs(rows.loc["emb.weight", "bad - good"]) < 0.5  # the embedding is initialised alike
    assert sorted(p.rsplit("/", 1)[1] for p in result.plots) == ["compare_grad_to_data.png",
                                                                 "compare_update_to_data.png"]
    saved = pd.read_csv(tmp_path / "cmp" / "compare.csv")
    np.testing.assert_allclose(saved["bad - good"], table["bad - good"])
    text = format_comparison(table)
    assert "bad - good" in text and "+" in text.splitlines()[2]


@pytest.mark.slow
def test_a_run_compared_with_itself_differs_by_zero(demo_runs):
    table = compare([demo_runs[0], demo_runs[0]], labels=["a", "b"]).table("grad_to_data")
    assert (table["b - a"] == 0).all() and table["a"].notna().all()


@pytest.mark.slow
def test_lr_a_vs_lr_b_overlays_the_runs_per_weight(tmp_path):
    small = record_deep(tmp_path / "lr-small.h5", n_layers=2, steps=4, lr=0.01)
    large = record_deep(tmp_path / "lr-large.h5", n_layers=2, steps=4, lr=0.1)
    result = compare([small, large], plots=True)
    table = result.table().set_index("param")
    # Same seed, same data: the first SGD step's update is exactly 10x larger, and later ones stay near that.
    ratios = result.ratios[result.ratios["step"] == 0].set_index(["run", "param"])["update_to_data"]
    for name in table.index:
        assert ratios[("lr-large", name)] - ratios[("lr-small", name)] == pytest.approx(1, abs=1e-6)
    assert (table["lr-large - lr-small"].between(0.5, 1.5)).all()
    with upd.open_run(small) as a, upd.open_run(large) as b:
        keys = [(0, n) for n in table.index]
        fig = plots.compare_figure({"lr-small": a.ratios(), "lr-large": b.ratios()},
                                   {"lr-small": a.params(), "lr-large": b.params()}, keys, "update_to_data",
                                   scalars={"lr-small": a.scalars(), "lr-large": b.scalars()}, guide=-3)
    lr_ax, loss_ax, *weight_axes = fig.axes[:2 + len(keys)]
    assert lr_ax.get_title() == "learning rate" and loss_ax.get_title() == "loss"
    assert sorted(line.get_ydata()[0] for line in lr_ax.get_lines()) == pytest.approx([0.01, 0.1])
    for ax, name in zip(weight_axes, table.index):
        assert ax.get_title() == name
        runs = [line for line in ax.get_lines() if len(line.get_xdata()) == 4]
        assert len(runs) == 2  # one line per run
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["lr-small", "lr-large"]
    plots.plt.close(fig)


@pytest.mark.slow
def test_weights_one_run_lacks_show_as_missing(tmp_path):
    two = record_deep(tmp_path / "two.h5", n_layers=2, steps=2)
    three = record_deep(tmp_path / "three.h5", n_layers=3, steps=2)
    table = compare([two, three]).table().set_index("param")
    assert list(table.index) == ["0.weight", "2.weight", "4.weight", "6.weight"]
    assert np.isnan(table.loc["6.weight", "two"]) and np.isfinite(table.loc["6.weight", "three"])
    assert np.isnan(table.loc["6.weight", "three - two"])
    assert "-" in format_comparison(table.reset_index()).splitlines()[-1]


def test_labels_and_bad_calls(tmp_path):
    assert run_labels(["runs/a/x.h5", "runs/b/x.h5"]) == ["a/x", "b/x"]
    assert run_labels(["good.h5", "bad.h5"]) == ["good", "bad"]
    one = record_deep(tmp_path / "one.h5", n_layers=1, steps=1)
    with pytest.raises(ValueError, match="at least two"):
        compare([one])
    assert compare([one, one]).labels == ["one #1", "one #2"]  # the same file twice still tells them apart
    with pytest.raises(ValueError, match="distinct labels"):
        compare([one, one], labels=["x", "x"])
    with pytest.raises(ValueError, match="quantity"):
        median_table(pd.DataFrame(columns=["run"]), ["a"], "lr")
