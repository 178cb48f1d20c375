"""The default cadence of full records and the size warning (upd/recorder/cadence.py): the arithmetic, and a
recording with no options."""
import warnings

import pytest
import torch

import upd
from upd.recorder import cadence


def test_the_default_cadence_thins_out_with_the_record_size():
    six_m = cadence.full_record_bytes(4 * 5_800_000, cadence.state_tensors("torch.optim.AdamW"))
    gpt2 = cadence.full_record_bytes(4 * 124_439_808, cadence.state_tensors("AdamW"))
    assert six_m == 116_000_000 and cadence.default_every(six_m) == 200
    assert cadence.default_every(gpt2) == 5000
    assert cadence.default_every(1_000_000) == cadence.DEFAULT_EVERY  # a small model: every 100
    assert [s for s in range(450) if cadence.is_full_step(s, 200)] == [0, 1, 200, 400]


def test_one_warning_names_the_projected_size_and_the_cadence_that_fits():
    record = cadence.full_record_bytes(4 * 60_000, 2)  # the 60k-parameter model: 1.2 MB a record
    assert cadence.size_warning(record, 100) is None
    text = cadence.size_warning(record, 1)
    assert "1.2 GB per 1,000 steps" in text and "every=100" in text and "bfloat16" in text
    assert cadence.bytes_per_1000_steps(record, None) == 0


def _train(model, opt, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()


@pytest.mark.slow
def test_a_recording_with_no_options_has_statistics_at_every_step_and_full_records_at_the_default_cadence(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", upd.RecorderWarning)  # a small model: no size warning
        with upd.record(tmp_path / "run.h5", model, opt):
            _train(model, opt, 102)
    with upd.open_run(tmp_path / "run.h5") as run:
        recorded = run.optimizers[0]
        assert recorded.steps.tolist() == [0, 1, 100]  # both first steps, then every 100th
        assert recorded.meta["full_records"] == {"every": 100, "first_steps": 2}
        assert sorted(run.stats()["step"].unique().tolist()) == list(range(102))
        assert run.options["every"] == "auto" and run.options["stats_every"] == 1
    assert upd.verify(tmp_path / "run.h5").exit_code == 0  # the first steps verify: from fresh state and with it


@pytest.mark.slow
def test_the_default_cadence_follows_each_optimizers_record_size(tmp_path, monkeypatch):
    """The cadence comes from what a full record of this optimizer weighs (not a fixed 100): with a budget that
    a record of the larger optimizer exceeds at every 100th step, that one records at a sparser cadence."""
    torch.manual_seed(0)
    small, large = torch.nn.Linear(8, 2), torch.nn.Linear(64, 64)
    opts = [torch.optim.SGD(small.parameters(), lr=0.1), torch.optim.Adam(large.parameters(), lr=1e-3)]
    large_record = cadence.full_record_bytes(4 * (64 * 64 + 64), 2)  # before, grad, after, two moments: float32
    monkeypatch.setattr(cadence, "BUDGET_BYTES", large_record * 1000 // 150)  # every 100th is too dense for it
    with upd.record(tmp_path / "run.h5", torch.nn.ModuleList([small, large]), opts):
        pass
    with upd.open_run(tmp_path / "run.h5") as run:
        assert [o.meta["full_records"]["every"] for o in run.optimizers] == [100, 200]


@pytest.mark.slow
def test_an_explicit_cadence_that_would_fill_the_disk_warns_once(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Linear(256, 256))  # 68k parameters: 1.4 MB a record
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.warns(upd.RecorderWarning) as caught:
        with upd.record(tmp_path / "dense.h5", model, opt, every=1):
            _train(model, opt, 3)
    texts = [str(w.message) for w in caught if "per 1,000 steps" in str(w.message)]
    assert len(texts) == 1 and "1.4 GB per 1,000 steps" in texts[0] and "every=100" in texts[0], texts
    assert caught[0].filename == __file__  # at the user's upd.record line
    with warnings.catch_warnings():
        warnings.simplefilter("error", upd.RecorderWarning)
        with upd.record(tmp_path / "sparse.h5", model, opt, every=10):  # 140 MB per 1,000 steps: quiet
            _train(model, opt, 3)
