"""What `upd info`, `analyze` and `verify` tell about a run beyond its ratios: frozen parameters, whether the run was
closed cleanly or resumed, logged scalars, no verdict about zero weights; and the reader's errors for a caller's
mistake (a wrong kind, a misspelt parameter name) name the caller's mistake."""
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd.cli.main import main

from tests.harness.paths import REPO_ROOT
from tests.harness.training import MLP, train_steps


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def frozen_run(path):
    torch.manual_seed(0)
    model = MLP()
    model.fc1.weight.requires_grad_(False)  # frozen, but kept in the optimizer
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=3)
    return path


@pytest.mark.slow
def test_frozen_parameters_are_listed_by_info_analyze_and_verify(tmp_path):
    path = frozen_run(tmp_path / "frozen.h5")
    with upd.open_run(path) as run:
        assert [p.name for p in run.iter_params()] == ["fc1.bias", "fc2.weight", "fc2.bias"]
    code, out = cli("info", path)
    assert code == 0 and "frozen (requires_grad=False when recording started; no gradient, no rows): fc1.weight" in out
    code, out = cli("analyze", path, "--no-plots")
    assert code == 0 and "frozen (requires_grad=False; no gradient, not analyzed): fc1.weight" in out
    code, out = cli("verify", path)
    assert code == 0 and "frozen (requires_grad=False; no gradient, not verified): fc1.weight" in out
    # a run without frozen parameters says nothing of the kind
    unfrozen = tmp_path / "plain.h5"
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(unfrozen, model, opt, every=1):
        train_steps(model, opt, steps=2)
    assert "frozen (" not in cli("info", unfrozen)[1] and "frozen (" not in cli("verify", unfrozen)[1]


def test_info_says_closed_cleanly_and_resumed(tmp_path):
    path = tmp_path / "run.h5"
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(path, model, opt, every=1) as rec:
        train_steps(model, opt, steps=2)
        rec.log(after_step=True, loss=1.5)
    out = cli("info", path)[1]
    assert "  closed cleanly\n" in out and "resumed" not in out
    assert "logged scalars at 2 steps: " in out and "loss" in out
    with upd.record(path, model, opt, resume=True, every=1):
        train_steps(model, opt, steps=1)
    assert "closed cleanly; resumed 1 time(s) (" in cli("info", path)[1]


@pytest.mark.slow
def test_info_says_when_a_run_was_not_closed(tmp_path):
    """A process that dies without closing its recorder (os._exit: no atexit, no close)."""
    path = tmp_path / "crashed.h5"
    script = ("import os, torch, upd\nfrom tests.harness.training import MLP, train_steps\n"
              "m = MLP(); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              f"rec = upd.record({str(path)!r}, m, o, every=1)\ntrain_steps(m, o, steps=2)\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", script], check=True, env=dict(os.environ, PYTHONPATH=REPO_ROOT),
                   timeout=120)
    code, out = cli("info", path)
    assert code == 0 and "NOT closed cleanly (the recording process crashed or was killed" in out


@pytest.mark.slow
def test_no_verdict_about_zero_weights(tmp_path):
    path = tmp_path / "typo.h5"
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(upd.RecorderWarning, match="match none"):
        rec = upd.record(path, model, opt, include="*.wieght", every=1)
    with rec:
        train_steps(model, opt, steps=2)
    code, out = cli("analyze", path, "--no-plots")
    assert code == 0 and "all weights within" not in out and "nothing to judge" in out
    biases_only = tmp_path / "biases.h5"
    with upd.record(biases_only, model, opt, include="*.bias", every=1):
        train_steps(model, opt, steps=2)
    out = cli("analyze", biases_only, "--no-plots")[1]
    assert "all weights within" not in out and "nothing to judge" in out
    weights = tmp_path / "weights.h5"
    with upd.record(weights, model, opt, include="*.weight", every=1):
        train_steps(model, opt, steps=2)
    assert "nothing to judge" not in cli("analyze", weights, "--no-plots")[1]


def test_reading_a_wrong_kind_or_name_blames_the_call(tmp_path):
    path = frozen_run(tmp_path / "run.h5")
    with upd.open_run(path) as run:
        p = run.param("fc2.weight")
        with pytest.raises(ValueError, match=r"read\(\) takes one of 'param', 'grad', 'param_after' or "
                                             r"'state/<key>' \(keys here: step, exp_avg, exp_avg_sq\), not 'state'"
                                             r"; the whole state at a row: state_at\(row\)"):
            p.read("state", 0)
        assert p.read("state/exp_avg", 0).shape == (4, 12)
        with pytest.raises(KeyError, match=r"no parameter 'fc2.weigth'; did you mean 'fc2.weight'\?.* Recorded "
                                           r"parameters: fc1.bias, fc2.weight, fc2.bias"):
            run.param("fc2.weigth")
        with pytest.raises(KeyError, match=r"no parameter 'decoder' Recorded parameters: fc1.bias"):
            run.param("decoder")


def test_an_embedding_model_has_its_frozen_table_named(tmp_path):
    """Frozen embeddings (a common fine-tuning setup) next to trained layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "emb.h5"
    with upd.record(path, model, opt, every=1):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randint(0, 10, (3, 2))).sum().backward()
            opt.step()
    with upd.open_run(path) as run:
        from upd.runfile.reader import frozen_params
        assert frozen_params(run.optimizers[0]) == ["0.weight"]
        assert "0.weight" not in run.optimizers[0].param_records
