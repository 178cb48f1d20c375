"""The flight recorder: nothing on disk while training is healthy, the K steps before a blow-up when it is not."""
import os

import pytest
import torch
from torch import nn

import upd

from tests.harness.training import MLP


def diverging_run(tmp_path, k=5, jump_at=15, steps=30, **options):
    """SGD whose lr jumps by 1e4 at `jump_at`: gradient and update norms explode, then NaN/Inf follow."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = str(tmp_path / "run.h5")
    first_nan = None
    g = torch.Generator().manual_seed(0)
    with upd.record(path, model, opt, every=None, flight_recorder=k, **options) as rec:
        for step in range(steps):
            if step == jump_at:
                opt.param_groups[0]["lr"] = 500.0
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))
            loss.backward()
            if first_nan is None and not all(torch.isfinite(p.grad).all() for p in model.parameters()):
                first_nan = step
            opt.step()
            if first_nan is None and not all(torch.isfinite(p).all() for p in model.parameters()):
                first_nan = step  # the update itself overflowed
    return path, rec, first_nan


def test_nothing_is_written_while_training_is_healthy(tmp_path):
    path, rec, first_nan = diverging_run(tmp_path, jump_at=10_000, steps=20)
    assert first_nan is None and rec.dumps == []
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 0 and run.dumps().empty
    assert os.path.getsize(path) < 50_000


def test_divergence_dumps_the_steps_before_the_blow_up_and_they_verify(tmp_path):
    k = 5
    path, rec, first_nan = diverging_run(tmp_path, k=k)
    assert first_nan is not None, "the run was meant to diverge"
    with upd.open_run(path) as run:
        dumps = run.dumps().to_dict("records")
        recorded = sorted(int(s) for s in run.optimizers[0].steps)
    assert dumps and dumps == rec.dumps
    # The first trigger is the norm spike when the lr jumps (step 15), before any NaN; the ring then refills and
    # a NaN/Inf dump follows. Every dump holds at most K steps, and their reasons are stored.
    assert "spike" in dumps[0]["reason"] and dumps[0]["trigger_step"] == 15
    assert dumps[0]["steps"] == list(range(15 - k + 1, 16))
    nan_dumps = [d for d in dumps if "non-finite" in d["reason"]]
    assert nan_dumps, dumps
    first_nan_dump = nan_dumps[0]
    assert first_nan_dump["trigger_step"] == first_nan
    # The K steps up to the first NaN are on disk (except those an earlier dump already wrote).
    assert set(range(first_nan - k + 1, first_nan + 1)) <= set(recorded)
    # ... and replay like any record: no dumped step before the NaN mismatches. As the weights blow up, float32's
    # spacing at their size outgrows Adam's lr-sized update on most elements: those checks are inconclusive (and
    # say so), the ones before the blow-up match.
    report = upd.verify(path)
    finite = report.checks[report.checks["step"] < first_nan]
    assert len(finite) and (finite["status"] != "mismatch").all(), report.summary()
    unresolved = finite["update_resolved"] < 0.5
    assert (finite.loc[unresolved, "status"] == "inconclusive").all()
    assert (finite.loc[~unresolved, "status"] == "match").all() and (~unresolved).sum() > len(finite) // 2


def test_user_dump(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    g = torch.Generator().manual_seed(0)
    with upd.record(path, model, opt, every=None, stats_every=1, flight_recorder=3) as rec:
        for step in range(8):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
            opt.step()
            if step == 6:
                rec.dump("loss looked odd")
    with upd.open_run(path) as run:
        assert run.dumps()["reason"].tolist() == ["loss looked odd"] and run.dumps()["steps"].tolist() == [[4, 5, 6]]
        assert list(run.optimizers[0].steps) == [4, 5, 6]
        assert len(run.stats()["step"].unique()) == 8  # statistics of every step all along
    report = upd.verify(path)
    assert report.exit_code == 0 and report.matched == 3 * 4


def test_flight_recorder_options_are_checked(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="flight_recorder"):
        upd.record(str(tmp_path / "a.h5"), model, opt, flight_recorder=0, every=1)
    with pytest.raises(RuntimeError, match="flight_recorder"):
        with upd.record(str(tmp_path / "b.h5"), model, opt, every=1) as rec:
            rec.dump()
