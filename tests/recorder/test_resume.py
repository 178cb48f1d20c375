"""resume=True: a training restarted from a checkpoint appends to the same run with the right step numbers."""
import copy

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema

from tests.harness.training import MLP, train_steps


def checkpointed_run(tmp_path, make_opt, first=4, second=3):
    path = str(tmp_path / "run.h5")
    torch.manual_seed(0)
    model = MLP()
    opt = make_opt(model)
    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=first, seed=1)
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict()}
    # "a new process": fresh objects loaded from the checkpoint
    model2 = MLP()
    opt2 = make_opt(model2)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    with upd.record(path, model2, opt2, resume=True, every=1):
        train_steps(model2, opt2, steps=second, seed=2)
    return path


@pytest.mark.parametrize("make_opt", [lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                                      lambda m: torch.optim.SGD(m.parameters(), lr=0.1)], ids=["adam", "sgd"])
def test_resume_continues_step_numbers_and_verifies(tmp_path, make_opt):
    path = checkpointed_run(tmp_path, make_opt)
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].steps) == list(range(7))
        assert run.param("fc1.weight").num_rows == 7
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    # the boundary step 3 -> 4 was checked like any other: continuity, and the state where there is one
    boundary = report.checks[(report.checks["step"] == 3) & (report.checks["param"] == "fc1.weight")].iloc[0]
    assert boundary["status"] == "match"
    with upd.open_run(path) as run:
        assert bool(boundary["state_checked"]) == bool(run.param("fc1.weight").state_keys)


def test_resume_without_a_file_starts_a_new_run(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "new.h5")
    with upd.record(path, model, opt, resume=True, every=1):
        train_steps(model, opt, steps=2)
    assert list(upd.open_run(path).optimizers[0].steps) == [0, 1]


def test_resume_refuses_a_different_model(tmp_path):
    path = checkpointed_run(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), first=2, second=1)
    bigger = MLP(n_hidden=13)
    with pytest.raises(ValueError, match=r"shapes changed: .*fc1.weight \[12, 16\] -> \[13, 16\]"):
        upd.record(path, bigger, torch.optim.Adam(bigger.parameters()), resume=True, every=1)
    other = nn.Sequential(nn.Linear(16, 4))
    with pytest.raises(ValueError, match="parameters no longer in optimizer 0: fc1.bias"):
        upd.record(path, other, torch.optim.Adam(other.parameters()), resume=True, every=1)
    same = MLP()
    with pytest.raises(ValueError, match="was torch.optim.Adam, now torch.optim.SGD"):
        upd.record(path, same, torch.optim.SGD(same.parameters(), lr=0.1), resume=True, every=1)
    with upd.open_run(path) as run:  # the refused attempts left the run as it was
        assert run.optimizers[0].num_records == 3
    assert upd.verify(path).exit_code == 0


def test_resume_drops_the_half_written_record_of_a_crash(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=3)
    with h5py.File(path, "r+") as f:  # what a kill between the data rows and the commit leaves behind
        grp = f[schema.PARAMETER.path(k=0, name='fc1.weight')]
        for name in ("record", "param", "grad"):
            grp[name].resize(grp[name].shape[0] + 1, axis=0)
        grp["record"][-1] = 3
        grp["param"][-1] = np.full(grp["param"].shape[1:], 123.0)
    with upd.record(path, model, opt, resume=True, every=1):
        train_steps(model, opt, steps=2, seed=5)
    with upd.open_run(path) as run:
        p = run.param("fc1.weight")
        assert list(p.records) == [0, 1, 2, 3, 4]
        assert not (p.read("param") == 123.0).any()
    assert upd.verify(path).exit_code == 0


def test_resume_from_an_older_checkpoint_truncates_the_run(tmp_path):
    """nanoGPT's pattern: a checkpoint after step 3, two more steps recorded, then a restart from the checkpoint. The
    documented rule (docs/reliability.md, "Resume"): the run is truncated back to the resumed step, with one warning;
    steps(), info and verify then see one history. Before the rule, steps 4 and 5 were there twice."""
    path = str(tmp_path / "run.h5")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(path, model, opt, stats_every=1, every=1) as rec:
        train_steps(model, opt, steps=4, seed=1)
        checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # as torch.save would
        rec.log(loss=1.0)  # scalar rows of the steps to be dropped too
        train_steps(model, opt, steps=2, seed=3)
    model2 = MLP()
    model2.load_state_dict(checkpoint["model"])
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(checkpoint["opt"])
    with pytest.warns(upd.RecorderWarning, match="resumes at step 4.*truncated back.*2 full record") as caught:
        with upd.record(path, model2, opt2, stats_every=1, resume=True, every=1):
            train_steps(model2, opt2, steps=3, seed=2)
    assert sum("truncated back" in str(w.message) for w in caught) == 1
    with upd.open_run(path) as run:
        steps = run.steps()
        assert steps["step"].tolist() == list(range(7))  # one row per step, none twice
        assert steps["record"].tolist() == list(range(7)) and steps["stats_row"].tolist() == list(range(7))
        assert run.param("fc1.weight").num_rows == 7
        assert (run.scalars()["step"] >= 4).sum() == 3  # the dropped step 4's loss went with it
        assert run.resumes[-1]["truncated"] == [{"optimizer": 0, "from_step": 4, "records": 2, "stats_rows": 2,
                                                 "scalar_rows": 2}]
        info = run.describe()["optimizers"][0]
        assert info["records"] == info["stats_steps"] == 7
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    assert len(report.checks[report.checks["param"] == "fc1.weight"]) == 7  # verify counts what info counts
