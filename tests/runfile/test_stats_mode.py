"""Statistics-only runs are whole: model order, param groups and their hyperparameters per step, backward passes,
state keys, everywhere a full run has them (info, steps(), params(), stats(), analyze, compare, jobs).

One model throughout: a 24-module Sequential (12 Linear layers at 0, 2, ..., 22: HDF5 and JSON list them 0, 10,
12, ..., 2, 20, 22, 4, ...), AdamW with two param groups (weights with weight decay 0.1, biases with none), a
StepLR schedule and two backward passes per step (gradient accumulation).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import upd
from upd.analyzer.plots import plotted_keys
from upd.cli.main import main
from upd.runfile.ranks import rank_path

pytestmark = pytest.mark.slow  # four recorded runs (about 3 s each under load), analyze and compare

STEPS = 6
LAYERS = [str(i) for i in range(0, 24, 2)]
WEIGHTS = [f"{layer}.weight" for layer in LAYERS]
# The optimizer's order: the weights' group, then the biases'.
MODEL_ORDER = WEIGHTS + [f"{layer}.bias" for layer in LAYERS]
LR = [0.01 * 0.5 ** (step // 2) for step in range(STEPS)]  # StepLR(step_size=2, gamma=0.5), as scheduled


def train(path: str, steps: int = STEPS, **options) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(5, 5) if i % 2 == 0 else torch.nn.Tanh() for i in range(24)])
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1},
                             {"params": biases, "weight_decay": 0.0, "betas": (0.8, 0.99)}], lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    with upd.record(path, model, opt, **{"every": 1, **options}):
        for _ in range(steps):
            for _ in range(2):
                model(torch.randn(4, 5, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stats_mode")
    return {"stats": train(str(folder / "stats.h5"), every=None, stats_every=1),
            "full": train(str(folder / "full.h5")),
            "mixed": train(str(folder / "mixed.h5"), every=4, stats_every=1),
            "folder": folder}


def test_a_statistics_only_run_lists_its_parameters_in_model_order(runs):
    with upd.open_run(runs["stats"]) as run, upd.open_run(runs["full"]) as full:
        assert run.params()["param"].tolist() == MODEL_ORDER == full.params()["param"].tolist()
        stats = run.stats()
        assert list(dict.fromkeys(stats["param"])) == MODEL_ORDER
        assert [p["name"] for p in run.describe()["optimizers"][0]["params"]] == MODEL_ORDER
        analysis, full_analysis = upd.analyze(run), upd.analyze(full)
        weights = [p for p in analysis.summary["param"] if p.endswith("weight")]
        assert weights == WEIGHTS == [p for p in full_analysis.summary["param"] if p.endswith("weight")]
        # the ratio figures' order, which is their legend's colour order: the same for both runs of the model
        assert plotted_keys(analysis.ratios, run.params(), False) == [(0, w) for w in WEIGHTS] == \
            plotted_keys(full_analysis.ratios, full.params(), False)
    comparison = upd.compare([runs["stats"], runs["full"]], labels=["stats", "full"])
    assert comparison.table("update_to_data")["param"].tolist() == WEIGHTS
    out = CliRunner().invoke(main, ["info", runs["stats"]], catch_exceptions=False).output
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["param"]) + 1  # the table's header
    listed = [line.split()[0] for line in lines[start:start + len(MODEL_ORDER)]]
    assert listed == MODEL_ORDER, out


def test_info_shows_groups_rows_and_state_of_a_statistics_only_run(runs):
    with upd.open_run(runs["stats"]) as run:
        opt = run.describe()["optimizers"][0]
        assert opt["param_groups"] == 2 and opt["records"] == 0 and opt["stats_steps"] == STEPS
        assert {p["stats_rows"] for p in opt["params"]} == {STEPS}
        assert run.params()["stats_rows"].tolist() == [STEPS] * len(MODEL_ORDER)
    with upd.open_run(train(str(runs["folder"] / "state.h5"), every=None, stats_every=1, full_stats_every=1,
                            steps=2)) as run:  # the full statistics set holds the state's statistics
        assert run.params()["state"].unique().tolist() == ["step,exp_avg,exp_avg_sq"]  # as a full record lists them
    out = CliRunner().invoke(main, ["info", runs["stats"]], catch_exceptions=False).output
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == [MODEL_ORDER[0]])
    assert "2 param group(s)" in out and row[4:6] == ["0", str(STEPS)], out  # full rows, statistics rows


def test_steps_of_a_statistics_only_run_have_the_scheduled_lr_and_the_backward_passes(runs):
    with upd.open_run(runs["stats"]) as run:
        steps = run.steps()
        assert steps["step"].tolist() == list(range(STEPS))
        assert steps["stats_row"].tolist() == list(range(STEPS)) and steps["record"].isna().all()
        assert steps["backward_pass"].tolist() == [2 * (s + 1) for s in range(STEPS)]  # two per step
        for group in (0, 1):
            np.testing.assert_allclose(steps[f"lr_group{group}"], LR)
        opt = run.optimizers[0]
        at_3 = opt.step_hparams(3)
        assert [g["weight_decay"] for g in at_3] == [0.1, 0.0]
        assert [g["betas"] for g in at_3] == [[0.9, 0.999], [0.8, 0.99]]
        assert [g["lr"] for g in at_3] == pytest.approx([LR[3], LR[3]])
        assert opt.step_hparams(STEPS) is None


def test_a_mixed_run_has_lr_and_backward_passes_on_its_statistics_rows(runs):
    with upd.open_run(runs["mixed"]) as run, upd.open_run(runs["full"]) as full:
        steps = run.steps()
        assert steps["step"].tolist() == list(range(STEPS))
        assert steps["record"].tolist() == [0, pd.NA, pd.NA, pd.NA, 1, pd.NA]
        np.testing.assert_allclose(steps["lr_group0"], LR)
        pd.testing.assert_series_equal(steps["backward_pass"], full.steps()["backward_pass"])
        assert run.optimizers[0].step_hparams(2) == full.optimizers[0].step_hparams(2)


def test_a_rank_file_job_lists_every_statistics_step_like_a_single_file(runs, tmp_path):
    """Two rank files of one replicated job, full records every 4th step, statistics at every step: the job's
    steps() is the single file's (it listed the 2 full-record steps only)."""
    job = str(tmp_path / "job.h5")
    for rank in range(2):
        train(rank_path(job, rank, 2), every=4, stats_every=1)
    with upd.open_run(job) as opened, upd.open_run(runs["mixed"]) as single:
        columns = ["optimizer", "record", "stats_row", "step", "backward_pass", "lr_group0", "lr_group1"]
        pd.testing.assert_frame_equal(opened.steps()[columns], single.steps()[columns])
        assert opened.params()["param"].tolist() == MODEL_ORDER
        assert opened.optimizers[0].step_hparams(3) == single.optimizers[0].step_hparams(3)
