"""Ratios, summary and lazy reading, checked against the seed question's own hand-written loop."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import upd
from upd.analyzer.summary import Thresholds, status_of, summarize

from tests.harness.paths import SAMPLE_RUNS
from tests.harness.training import MLP


def test_ratios_equal_the_seed_loop(tmp_path):
    """The seed question computes update:data by cloning before and after each step; the recorder must agree."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    expected = {}
    g = torch.Generator().manual_seed(0)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        for step in range(6):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            before = {n: p.data.clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            sched.step()
            for n, p in model.named_parameters():
                update = p.data - before[n]
                expected[(n, step)] = ((update.std() / before[n].std()).log10().item(),
                                       (grads[n].std() / before[n].std()).log10().item())
    ratios = upd.open_run(path).ratios()
    assert len(ratios) == len(expected) == 6 * 4
    for r in ratios.itertuples():
        u2d, g2d = expected[(r.param, r.step)]
        # the seed computes in float32, we in float64: agree to float32 precision
        assert r.update_to_data == pytest.approx(u2d, abs=2e-5)
        assert r.grad_to_data == pytest.approx(g2d, abs=2e-5)
    assert sorted(ratios["lr"].unique()) == pytest.approx([7.5e-4, 1.5e-3, 3e-3])


def test_degenerate_tensors_give_flags_not_crashes(tmp_path):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))  # one element: std undefined
            self.lin = nn.Linear(4, 3)
            nn.init.zeros_(self.lin.bias)  # zero variance at the first step
            self.unused_in_loss = nn.Parameter(torch.randn(3, 3))  # gets a zero gradient: zero update under SGD

        def forward(self, x):
            return self.lin(x) * self.scale + 0 * self.unused_in_loss.sum()

    torch.manual_seed(0)
    model = Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
    ratios = upd.open_run(path).ratios().set_index(["param", "step"])
    assert math.isnan(ratios.loc[("scale", 0), "update_to_data"])
    assert ratios.loc[("scale", 0), "flag"] == "one-element"
    assert ratios.loc[("lin.bias", 0), "flag"] == "zero-param-std"
    assert ratios.loc[("lin.bias", 0), "update_to_data"] == math.inf
    assert ratios.loc[("lin.bias", 1), "flag"] == ""  # it moved, so it has variance now
    assert ratios.loc[("unused_in_loss", 0), "update_to_data"] == -math.inf
    assert ratios.loc[("unused_in_loss", 0), "flag"] == "zero-update"
    summary = upd.analyze(path).summary.set_index("param")
    assert summary.loc["unused_in_loss", "status"] == "n/a (no finite ratio)"
    assert summary.loc["lin.weight", "status"] in ("ok", "HIGH", "LOW")


def test_streaming_in_small_blocks_gives_the_same_table():
    path = SAMPLE_RUNS[0]
    with upd.open_run(path) as run:
        whole = run.ratios()
        p = run.param("fc1.weight")
        assert p.block_rows(block_bytes=20_000) < p.num_rows  # really several blocks
        blocked = run.ratios(block_bytes=20_000)
    # Row-wise reductions may vectorise differently with the block size: equal to float64 rounding.
    pd.testing.assert_frame_equal(whole, blocked, rtol=1e-12)


def test_status_thresholds():
    t = Thresholds(high=-1.5, low=-4.5)
    assert status_of(-3.0, (4, 4), t) == "ok"
    assert status_of(-1.0, (4, 4), t) == "HIGH"
    assert status_of(-5.0, (4, 4), t) == "LOW"
    assert status_of(-1.0, (4,), t) == "n/a (not a weight)"
    assert status_of(float("nan"), (4, 4), t) == "n/a (no finite ratio)"
    assert status_of(-2.0, (4, 4), Thresholds(high=-2.5, low=-3.5)) == "HIGH"
    with pytest.raises(ValueError):
        Thresholds(high=-5, low=-4)


def test_summary_latest_and_median():
    with upd.open_run(SAMPLE_RUNS[0]) as run:
        ratios = run.ratios()
        summary = summarize(ratios, run.params()).set_index("param")
    w = ratios[ratios["param"] == "fc1.weight"].sort_values("step")
    assert summary.loc["fc1.weight", "latest_update_to_data"] == w["update_to_data"].iloc[-1]
    assert summary.loc["fc1.weight", "median_update_to_data"] == pytest.approx(np.median(w["update_to_data"]))
    assert summary.loc["fc1.weight", "records"] == 20
