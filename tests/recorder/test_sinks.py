"""Live sinks (upd.record(..., sinks=[...])): a user's own sink on real training gets each statistics step's
per-parameter statistics and its logged scalars together, off the training thread, in step order; a sink that
raises is warned about once and dropped while training, the file and the other sinks go on."""
import threading
import warnings

import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema as upd_schema
from upd.sinks import SinkStep, metrics

from tests.harness.training import MLP


class Collect:
    """A user's own sink: keeps what it is given, and on which thread."""

    def __init__(self):
        self.steps, self.threads, self.closed = [], set(), 0

    def write(self, steps):
        self.threads.add(threading.current_thread().name)
        self.steps.extend(steps)

    def close(self):
        self.closed += 1


class Raises(Collect):
    def write(self, steps):
        super().write(steps)
        raise RuntimeError("the dashboard is down")


def train(rec, model, optimizers, steps):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        rec.log(loss=loss)
        for opt in optimizers:
            opt.step()


def test_a_users_sink_gets_each_steps_statistics_and_scalars_together(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sink = Collect()
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=3, sinks=[sink]) as rec:
        train(rec, model, [opt], steps=7)
    assert sink.closed == 1
    assert threading.main_thread().name not in sink.threads  # called on the writer thread only
    assert [s.step for s in sink.steps] == list(range(7))  # every step logged a loss; in step order
    with upd.open_run(path) as run:
        stats = run.stats().set_index(["param", "step"])
        scalars = run.scalars().set_index("step")
    for s in sink.steps:
        assert isinstance(s, SinkStep) and s.optimizer == 0
        assert s.scalars["loss"] == pytest.approx(scalars.loc[s.step, "loss"])
        if s.step % 3:
            assert s.params == {}
            continue
        assert set(s.params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        for column in ("update_to_data", "grad_to_data", "param_norm"):
            assert s.params["fc2.weight"][column] == pytest.approx(stats.loc[("fc2.weight", s.step), column])
        # the recorder's own scalars arrive with the step's statistics, not 64 steps later
        assert {"loss", upd_schema.SCALAR_GRAD_NORM_AT_STEP} <= set(s.scalars)
        tags = metrics(s)
        assert tags["update_to_data/fc1.weight"] == s.params["fc1.weight"]["update_to_data"]
        assert tags["scalars/loss"] == s.scalars["loss"]


def test_a_sink_that_raises_is_warned_about_once_and_dropped(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    first, second = torch.optim.SGD(model.fc1.parameters(), lr=0.1), torch.optim.Adam(model.fc2.parameters())
    bad, good = Raises(), Collect()
    path = str(tmp_path / "run.h5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, model, [first, second], stats_every=1, sinks=[bad, good], every=1) as rec:
            train(rec, model, [first, second], steps=4)
            rec_active = rec.active
    said = [str(w.message) for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(said) == 1 and "the dashboard is down" in said[0] and "training and the run file go on" in said[0]
    assert rec_active and rec.error is None
    assert len(bad.steps) >= 1 and bad.closed == 1  # dropped after its first write, closed with the recorder
    assert {(s.optimizer, s.step) for s in good.steps if s.params} == {(k, i) for k in (0, 1) for i in range(4)}
    assert {name for s in good.steps if s.optimizer == 1 for name in s.params} == {"fc2.weight", "fc2.bias"}
    assert "update_to_data/opt1:fc2.weight" in metrics(next(s for s in good.steps if s.optimizer == 1 and s.params))
    with upd.open_run(path) as run:
        assert len(run.stats()) == 4 * 4 and len(run.scalars()) == 8


def test_sinks_take_objects_with_write_and_close(tmp_path):
    with pytest.raises(TypeError, match=r"sinks= takes objects with write\(steps\) and close\(\)"):
        upd.record(str(tmp_path / "run.h5"), MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1), sinks=[object()], every=1)
    assert not (tmp_path / "run.h5").exists()


def test_sinks_alone_record_statistics_at_every_step(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    with upd.record(str(tmp_path / "run.h5"), model, opt, every=None, sinks=[sink]) as rec:
        train(rec, model, [opt], steps=2)
    assert [s.step for s in sink.steps if s.params] == [0, 1]
