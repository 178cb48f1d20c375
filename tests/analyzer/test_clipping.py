"""Was gradient clipping active? Real runs with and without clip_grad_norm_, with gradient accumulation and
GradScaler, against the norms the training loop itself saw."""
import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd.analyzer.clipping import clipping_by_step
from tests.harness.clipping import clipping_summary
from upd.cli.main import main
from upd.runfile import schema

from tests.harness.training import MLP

MAX_NORM = 2.1  # between the small and the large total norms of this run


def train(path, steps=8, clip=None, accumulate=1, scaler=None):
    """A recorded loop; returns clip_grad_norm_'s return value per step (the total norm before clipping)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(0)
    returned = []
    with upd.record(path, model, opt, every=1):
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(accumulate):
                x, y = torch.randn(8, 16, generator=g), 3 * torch.randn(8, 4, generator=g)
                loss = nn.functional.mse_loss(model(x), y) / accumulate
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            if clip is not None:
                returned.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    return returned


def test_clipped_steps_and_the_norm_before_clipping_are_the_loops_own(tmp_path):
    path = tmp_path / "clipped.h5"
    returned = train(path, clip=MAX_NORM, accumulate=2)  # two backward passes per step: the last one counts
    with upd.open_run(path) as run:
        by_step = clipping_by_step(run.scalars())
        summary = clipping_summary(run)
    assert list(by_step["norm_backward"]) == pytest.approx(returned, rel=1e-5)
    expected_clipped = [norm > MAX_NORM * 1.001 for norm in returned]
    assert 0 < sum(expected_clipped) < len(returned)  # the run has both kinds of step: the check can fail
    assert list(by_step["clipped"]) == expected_clipped
    assert list(by_step.loc[by_step["clipped"], "norm_step"]) == pytest.approx(
        [MAX_NORM] * sum(expected_clipped), rel=1e-5)
    assert (summary.clipped_steps, summary.measured_steps) == (sum(expected_clipped), len(returned))
    assert summary.clipped_to == pytest.approx(MAX_NORM, rel=1e-5)
    clipped_norms = [norm for norm, clipped in zip(returned, expected_clipped) if clipped]
    assert summary.median_norm_clipped == pytest.approx(float(np.median(clipped_norms)), rel=1e-5)
    assert summary.median_norm_backward == pytest.approx(float(np.median(returned)), rel=1e-5)
    last = max(step for step, clipped in enumerate(expected_clipped) if clipped)
    assert summary.last_clipped_step == last
    assert summary.text() == (f"gradient clipped to {MAX_NORM:.3g} on {sum(expected_clipped)}/{len(returned)} steps, "
                              f"the last at step {last} (pre-clip total norm median "
                              f"{summary.median_norm_clipped:.3g} on those, {summary.median_norm_backward:.3g} over "
                              f"all {len(returned)})")


def test_a_run_without_clipping_says_so(tmp_path):
    path = tmp_path / "plain.h5"
    train(path)
    with upd.open_run(path) as run:
        summary = clipping_summary(run)
        by_step = clipping_by_step(run.scalars())
    assert summary.clipped_steps == 0 and summary.clipped_to is None and summary.measured_steps == 8
    assert list(by_step["ratio"]) == pytest.approx([1.0] * 8, rel=1e-6)
    assert summary.text().startswith("gradient not clipped (8 steps measured")


def test_gradscaler_unscaling_is_not_clipping(tmp_path):
    path = tmp_path / "scaled.h5"
    train(path, steps=4, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    with upd.open_run(path) as run:
        summary = clipping_summary(run)
        by_step = clipping_by_step(run.scalars())
    assert summary.clipped_steps == 0 and summary.unscaled_steps == 4
    assert list(by_step["ratio"]) == pytest.approx([2.0**-10] * 4, rel=1e-6)
    assert "GradScaler" in summary.text()


def test_a_run_recorded_without_the_norms_has_no_summary(tmp_path):
    path = tmp_path / "old.h5"
    train(path, steps=2)
    with h5py.File(path, "r+") as f:  # as a file of an earlier version: no scalars table
        del f[f"optimizers/0/{schema.SCALARS}"]
    with upd.open_run(path) as run:
        assert clipping_summary(run) is None
        assert clipping_by_step(run.scalars()).empty
    assert "clipped" not in CliRunner().invoke(main, ["info", str(path)]).output


@pytest.mark.slow
def test_info_and_analyze_say_whether_the_gradient_was_clipped(tmp_path):
    path = tmp_path / "clipped.h5"
    returned = train(path, clip=MAX_NORM)
    with upd.open_run(path) as run:
        line = clipping_summary(run).text()
    assert line.startswith(f"gradient clipped to {MAX_NORM:.3g} on {sum(n > MAX_NORM * 1.001 for n in returned)}/8 "
                           "steps, the last at step")
    for command in (["info", str(path)], ["analyze", str(path), "--no-plots"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 0, result.output
        assert line in result.output.splitlines()
