"""Verify replays the small parameters of a param group together (upd/replay/batch.py): the checks are the same
numbers as replaying each parameter on its own, a corrupted parameter or state is still caught (and explained), and
what cannot be batched goes back to the one-by-one path."""
import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import upd
from upd.replay import batch, engine, parallel
from upd.runfile import tensor_blocks
from upd.runfile import schema

from tests.harness.cases import all_cases
from tests.harness.replay_matrix import record_case
from tests.harness.training import MLP, train_steps

CASES = {c.id: c for c in all_cases()}
# Elementwise rules with scalar state (Adam's step, ASGD's eta and mu), sign-based steps (Rprop), conv and
# attention models (several shapes in one batch), two param groups.
FAMILIES = ["adamw-wd-forloop", "sgd-nesterov-conv", "asgd-plain-forloop", "rprop-conv", "radam-wd-conv",
            "nadam-wd-forloop", "adamax-wd-conv", "adadelta-foreach-attention", "rmsprop-momentum-forloop"]
QUICK = {"adamw-wd-forloop"}


@pytest.fixture
def batched(monkeypatch):
    """Spy on the batch path: (names given, names it returned checks for) per batch."""
    seen = []
    original = engine._batch_checks

    def spy(replay, members):
        found = original(replay, members)
        seen.append(([p.name for p, _ in members], sorted(found)))
        return found

    monkeypatch.setattr(engine, "_batch_checks", spy)
    return seen


def _one_by_one(path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(batch, "BATCH_ELEMENTS", 0)
        return upd.verify(path)


def _corrupt(path, pick, kind=schema.KIND_PARAM_AFTER, record=2):
    """Move one element of one recorded tensor of the parameter `pick` chooses far off, at one record."""
    with h5py.File(path, "r+") as f:
        params = f[schema.PARAMS_GROUP.path(k=0)]
        name = pick(list(params))
        p = params[name]
        row = list(p[schema.RECORD_INDEX][()]).index(record)
        before, after = p[schema.KIND_PARAM][row], p[schema.KIND_PARAM_AFTER][row]
        data = p[kind][row].reshape(-1).copy()
        data[data.size // 2] += 10 * (np.abs(after - before).max() + 1e-3)
        p[kind][row] = data.reshape(p[kind].shape[1:])
    return name


@pytest.mark.parametrize("corrupted", [False, True], ids=["honest", "corrupted"])
@pytest.mark.parametrize("case_id", [pytest.param(c, marks=() if c in QUICK else pytest.mark.slow) for c in FAMILIES])
def test_batched_replay_gives_the_same_checks_as_one_by_one(case_id, corrupted, tmp_path, monkeypatch, batched):
    path = record_case(CASES[case_id], str(tmp_path / "run.h5"))
    name = _corrupt(path, lambda names: sorted(n for n in names if n.endswith("bias"))[0]) if corrupted else None
    alone = _one_by_one(path, monkeypatch)
    assert not batched
    together = upd.verify(path)
    assert batched and all(len(given) > 1 for given, _ in batched)  # the batch path ran, on real batches
    pd.testing.assert_frame_equal(together.checks, alone.checks, check_exact=True)
    if corrupted:
        bad = together.checks[together.checks["status"] == "mismatch"]
        assert (name, 2) in set(zip(bad["param"], bad["record"])), together.summary()
        # the batch found it, and handed that parameter (alone) to the one-by-one path for its explanation
        assert any(name in given and name not in found for given, found in batched)
        assert bad["note"].str.startswith("recorded update differs").all()
    else:
        assert together.exit_code == alone.exit_code == 0
        assert all(sorted(given) == found for given, found in batched)  # every batched check stood


def _adamw_run(tmp_path, steps: int) -> str:
    """A recorded AdamW run (weight decay 0.1) of the MLP; its path."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=steps)
    return path


def test_a_corrupted_state_of_a_small_parameter_is_caught(tmp_path, monkeypatch, batched):
    path = _adamw_run(tmp_path, steps=5)
    name = _corrupt(path, lambda names: "fc2.bias", kind=f"{schema.STATE_GROUP}/exp_avg_sq", record=3)
    report = upd.verify(path)
    assert report.exit_code == 1
    bad = report.checks[report.checks["status"] == "mismatch"]
    # the state recorded before step 3 is what step 2 should have produced (and step 3 replays from it)
    assert set(bad["param"]) == {name} and bad["record"].min() == 2
    assert bad["note"].iloc[0].startswith("next record's optimizer state differs")
    assert (report.checks.loc[report.checks["param"] != name, "status"] == "match").all()
    others = ["fc1.weight", "fc1.bias", "fc2.weight"]
    assert batched == [(others + [name], sorted(others))]
    pd.testing.assert_frame_equal(report.checks, _one_by_one(path, monkeypatch).checks, check_exact=True)


def test_parameters_whose_scalar_state_differs_are_replayed_one_by_one(tmp_path, monkeypatch, batched):
    # fc2 gets no gradient at the first step, so Adam leaves it without state: at every recorded step its step
    # counter is one behind fc1's. Replayed as one tensor they would share one counter.
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.zero_grad()
    model.fc1(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    assert not opt.state[model.fc2.weight]
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=4)
    report = upd.verify(path)
    assert report.exit_code == 0 and report.matched == 16, report.summary()
    assert batched and all(found == [] for _, found in batched)  # the batch gave everything back
    pd.testing.assert_frame_equal(report.checks, _one_by_one(path, monkeypatch).checks, check_exact=True)


@pytest.mark.slow
def test_worker_processes_share_a_long_history_by_ranges_of_steps(tmp_path, monkeypatch):
    path = _adamw_run(tmp_path, steps=12)
    with upd.open_run(path) as run:
        params = run.optimizers[0].param_records.values()
        units = {(path, 0, p.name, 0, p.num_rows): p.numel * p.num_rows for p in params}
    split = parallel.split_rows(units, 2)
    cut = [u for u in split if u[2] == "fc1.weight"]
    assert len(cut) > 1 and sorted((lo, hi) for *_, lo, hi in cut)[-1][1] == 12  # ranges of steps, to the last
    name = _corrupt(path, lambda names: "fc1.weight", record=7)
    one = upd.verify(path)
    two = upd.verify(path, jobs=2)
    pd.testing.assert_frame_equal(two.checks, one.checks, check_exact=True)
    bad = two.checks[two.checks["status"] == "mismatch"]
    assert list(zip(bad["param"], bad["record"])) == [(name, 7)] and two.exit_code == 1
    assert sum(parallel.WORKER_CPU.values()) > 0


def test_batches_are_bounded_by_a_block_and_read_a_few_rows_at_a_time(tmp_path, monkeypatch, batched):
    # 12 elements per block: the two weights (48 and 24 elements, one param group) no longer fit in one batch; the
    # biases (8 and 3, the other group) still do, and are read one step (and the next) at a time
    path = record_case(CASES["adamw-wd-forloop"], str(tmp_path / "run.h5"))
    name = _corrupt(path, lambda names: "fc2.bias")
    monkeypatch.setattr(tensor_blocks, "BLOCK_ELEMENTS", 12)
    alone = _one_by_one(path, monkeypatch)
    together = upd.verify(path)
    assert [given for given, _ in batched] == [["fc1.bias", "fc2.bias"]]
    pd.testing.assert_frame_equal(together.checks, alone.checks, check_exact=True)
    bad = together.checks[together.checks["status"] == "mismatch"]
    assert list(zip(bad["param"], bad["record"])) == [(name, 2)]
