"""The figures on real recorded runs: what they draw (read back from the matplotlib objects), not that they exist."""
import warnings

import numpy as np
import pytest
import torch
from matplotlib.collections import QuadMesh
from torch import nn

import upd
from upd.analyzer import plots
from upd.analyzer.steps import compared_steps, describe_steps, full_record_steps, histogram_keys
from upd.analyzer.summary import Thresholds, summarize

from tests.harness.analysis_runs import record_deep
from tests.harness.training import MLP, train_steps


def _figure(path, column="update_to_data", thresholds=Thresholds(), **kwargs):
    with upd.open_run(path) as run:
        ratios, params, scalars = run.ratios(), run.params(), run.scalars()
    summary = summarize(ratios, params, thresholds)
    flagged = {(r.optimizer, r.param): r.status for r in summary.itertuples()}
    fig = plots.ratio_figure(ratios, params, column, title="t", scalars=scalars, thresholds=thresholds,
                             guide=thresholds.target, flagged=flagged, **kwargs)
    return fig, ratios, summary


def _axes_by_ylabel(fig):
    return {ax.get_ylabel(): ax for ax in fig.axes if ax.get_ylabel()}


@pytest.mark.slow
def test_many_weights_are_a_heatmap_in_model_order_with_the_flagged_marked(tmp_path):
    path = record_deep(tmp_path / "deep.h5", n_layers=12, steps=4)
    with upd.open_run(path) as run:
        medians = summarize(run.ratios(), run.params()).query("shape.str.contains('x')")["median_update_to_data"]
    # A high bound between the weights' medians: some weights are flagged HIGH, the others not.
    high = float(np.median(medians))
    fig, _, summary = _figure(path, thresholds=Thresholds(high=high, low=high - 5))
    main = fig.axes[0]
    assert any(isinstance(c, QuadMesh) for c in main.collections)  # a heatmap, not 13 lines
    assert not main.get_lines()
    names = [t.get_text().split("  ")[0] for t in main.get_yticklabels()]
    assert names == [f"{2 * i}.weight" for i in range(13)]  # model order: 2.weight before 10.weight
    assert names != sorted(names)
    statuses = dict(zip(summary["param"], summary["status"]))
    high_rows = [t for t in main.get_yticklabels() if statuses[t.get_text().split("  ")[0]] == "HIGH"]
    ok_rows = [t for t in main.get_yticklabels() if statuses[t.get_text().split("  ")[0]] == "ok"]
    assert high_rows and ok_rows
    assert all("HIGH" in t.get_text() and t.get_color() == plots.STATUS_COLOURS["HIGH"] for t in high_rows)
    assert all("HIGH" not in t.get_text() and t.get_color() == "black" for t in ok_rows)
    # The colour scale is centred on -3, the same in every run.
    mesh = next(c for c in main.collections if isinstance(c, QuadMesh))
    assert (mesh.norm.vmin + mesh.norm.vmax) / 2 == pytest.approx(-3)
    plots.plt.close(fig)


@pytest.mark.slow
def test_few_weights_are_lines_with_lr_and_loss_on_the_same_step_axis(tmp_path):
    path = record_deep(tmp_path / "few.h5", n_layers=3, steps=6)
    fig, ratios, _ = _figure(path)
    main = fig.axes[0]
    assert not any(isinstance(c, QuadMesh) for c in main.collections)
    assert len(main.get_lines()) == 4 + 3  # a line per weight, the -3 guide and the two bounds
    side = _axes_by_ylabel(fig)
    lr_ax, loss_ax = side["learning rate"], side["loss"]
    assert main.get_shared_x_axes().joined(main, lr_ax) and main.get_shared_x_axes().joined(main, loss_ax)
    (lr_line,) = lr_ax.get_lines()
    assert list(lr_line.get_xdata()) == list(range(6))
    np.testing.assert_allclose(lr_line.get_ydata(), [0.05] * 3 + [0.005] * 3)  # the StepLR's drop
    with upd.open_run(path) as run:
        logged = run.scalars()["loss"].to_numpy()
    (loss_line,) = loss_ax.get_lines()
    np.testing.assert_allclose(loss_line.get_ydata(), logged)
    plots.plt.close(fig)
    # Without a logged loss there is no loss axes to show (and no empty one).
    fig, _, _ = _figure(record_deep(tmp_path / "noloss.h5", n_layers=3, steps=3, log_loss=False))
    assert "loss" not in _axes_by_ylabel(fig) and "learning rate" in _axes_by_ylabel(fig)
    plots.plt.close(fig)


def _two_group_run(path, second_lr):
    """Two param groups, lr 0.05 and `second_lr`, both divided by 10 at step 3 (StepLR): six recorded steps."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD([{"params": model.fc1.parameters()},
                           {"params": model.fc2.parameters(), "lr": second_lr}], lr=0.05)
    with upd.record(path, model, opt, every=None, stats_every=1):
        train_steps(model, opt, steps=6, scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1))
    return path


def test_groups_with_one_schedule_are_one_labelled_lr_line_and_its_values_are_readable(tmp_path):
    fig, _, _ = _figure(_two_group_run(tmp_path / "same.h5", second_lr=0.05))
    lr_ax = _axes_by_ylabel(fig)["learning rate"]
    (line,) = lr_ax.get_lines()  # drawn apart, group 1's line hid group 0's
    assert line.get_label() == "group 0 = group 1"
    assert [t.get_text() for t in lr_ax.get_legend().get_texts()] == ["group 0 = group 1"]
    np.testing.assert_allclose(line.get_ydata(), [0.05] * 3 + [0.005] * 3)
    fig.canvas.draw()
    # 0.005..0.05 on a log scale holds one power of ten: minor ticks between are labelled
    minor = [t.get_text() for t in lr_ax.get_yticklabels(minor=True) if t.get_text()]
    assert minor, "only the major tick is labelled"
    plots.plt.close(fig)
    fig, _, _ = _figure(_two_group_run(tmp_path / "apart.h5", second_lr=0.01))
    lr_ax = _axes_by_ylabel(fig)["learning rate"]
    assert [line.get_label() for line in lr_ax.get_lines()] == ["group 0", "group 1"]
    plots.plt.close(fig)


@pytest.mark.slow
def test_a_one_step_run_draws_markers_on_an_integer_step(tmp_path):
    fig, _, _ = _figure(record_deep(tmp_path / "one.h5", n_layers=2, steps=1))
    main = fig.axes[0]
    weights = [line for line in main.get_lines() if len(line.get_xdata()) == 1]
    assert len(weights) == 3 and all(line.get_marker() == "o" for line in weights)
    fig.canvas.draw()
    assert list(fig.axes[1].get_xticks()) == [0]  # matplotlib alone puts ticks at -0.04, -0.02, ...
    plots.plt.close(fig)


@pytest.mark.slow
def test_step_ticks_are_integers_on_a_longer_run(tmp_path):
    fig, _, _ = _figure(record_deep(tmp_path / "long.h5", n_layers=2, steps=13))
    fig.canvas.draw()
    ticks = [t for t in fig.axes[1].get_xticks() if -0.5 <= t <= 12.5]
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks)
    plots.plt.close(fig)


def test_robust_range_ignores_far_tails_but_keeps_ordinary_ones():
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(10_000)
    lo, hi = plots.robust_range([normal])
    assert (lo, hi) == (normal.min(), normal.max())  # no far tail: every value drawn
    with_outlier = np.append(normal, 1e4)
    lo, hi = plots.robust_range([with_outlier])
    assert -4 < lo < -2 and 2 < hi < 4  # one far value does not set the range
    assert plots.robust_range([np.zeros(5)])[0] < 0 < plots.robust_range([np.zeros(5)])[1]
    assert plots.robust_range([np.zeros(0)]) is None


@pytest.mark.slow
def test_histograms_each_weight_its_own_range_at_first_middle_last(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    with torch.no_grad():
        model[0].weight[0, 0] = 1e4  # one huge value: with a shared range every curve would be a spike at 0
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    path = str(tmp_path / "tails.h5")
    with upd.record(path, model, opt, every=1):
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
    with upd.open_run(path) as run:
        keys = histogram_keys(run.params())
        steps = compared_steps(full_record_steps(run, keys))
        panels = plots.histogram_panels(run, keys, "param", steps)
    assert steps == [0, 2, 4]
    fig = plots.histogram_figure(panels, title="t", value_label="weight value")
    first, second = fig.axes[0], fig.axes[1]
    assert first.get_title() == "0.weight" and second.get_title() == "2.weight"
    assert first.get_xlim()[1] < 1 and second.get_xlim()[1] < 1  # neither range reaches 1e4
    assert len(first.get_lines()) == 3  # the three compared steps
    assert "outside" in " ".join(t.get_text() for t in first.texts)  # the cut tail is counted
    assert "outside" not in " ".join(t.get_text() for t in second.texts)
    assert first.get_xlabel() == second.get_xlabel() == "weight value" and first.get_ylabel() == "density"
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["step 0", "step 2", "step 4"]
    plots.plt.close(fig)


def test_compared_steps_and_their_description():
    assert compared_steps(np.arange(20)) == [0, 9, 19]
    assert compared_steps(np.array([0])) == [0]
    assert compared_steps(np.array([0, 1, 100, 200])) == [0, 100, 200]  # the default cadence: the middle by step
    assert compared_steps(np.arange(20), 7) == [7]
    with pytest.raises(ValueError, match=r"step 999.*steps 0\.\.19"):
        compared_steps(np.arange(20), 999)
    with pytest.raises(ValueError, match="no full-tensor record"):
        compared_steps(np.zeros(0, np.int64), 0)
    assert describe_steps(range(20)) == "0..19"
    assert describe_steps(range(0, 151, 25)) == "0, 25, ..., 150 (every 25)"
    assert describe_steps([3, 7]) == "3, 7"


@pytest.mark.slow
def test_statistics_mode_says_which_steps_and_keeps_model_order(tmp_path):
    path = record_deep(tmp_path / "stats.h5", n_layers=12, steps=6, every=3, stats_every=1)
    result = upd.analyze(path)
    names = list(result.summary["param"])
    with upd.open_run(path) as run:
        assert names == list(run.params()["param"])
        assert (run.ratios()["record"] == -1).all()  # the ratios really come from the statistics table
    assert names.index("2.weight") < names.index("10.weight") and names != sorted(names)
    assert result.hist_steps == [0, 3]
    assert "ratios from the per-step statistics (steps 0..5)" in result.notes
    assert "histograms at steps 0, 3, from the full-tensor records (steps 0, 3)" in result.notes


def _nan_run(path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, overwrite=True, every=1):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    return path


@pytest.mark.slow
def test_an_all_nan_run_draws_without_a_warning(tmp_path):
    path = _nan_run(str(tmp_path / "nan.h5"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels", numpy's "All-NaN slice", ...
        result = upd.analyze(path, plots=True, all_params=True)
    assert set(result.images) == {"update_to_data.png", "grad_to_data.png", "grad_histograms.png",
                                  "weight_histograms.png"}
    assert all(png.startswith(b"\x89PNG") for png in result.images.values())
    assert (result.summary["status"] == "n/a (no finite ratio)").sum() == 2


def test_long_runs_merge_steps_into_median_columns():
    values = np.arange(2 * 1000, dtype=float).reshape(2, 1000)
    values[1, :10] = np.nan  # a row with no finite value in the first merged column
    steps, merged = plots.merge_columns(np.arange(1000), values, 100)
    assert list(steps[:3]) == [0, 10, 20] and merged.shape == (2, 100)
    assert merged[0, 0] == np.median(values[0, :10]) and merged[0, 99] == np.median(values[0, 990:])
    assert np.isnan(merged[1, 0]) and merged[1, 1] == np.median(values[1, 10:20])
    same_steps, same = plots.merge_columns(np.arange(50), values[:, :50], 100)  # short enough: unchanged
    assert same is values[:, :50].base or np.array_equal(same, values[:, :50], equal_nan=True)
    assert len(same_steps) == 50
