"""Hyperparameters and step counters read from a file are checked before any replay rule sees them
(upd/replay/hparams.py): a value torch would refuse is the file's fault, exit 2 naming the field, never a rule
failure (exit 4) or a verify that never ends (an integer beta1 of 3 and a step counter of 1e9 made the Adam rule
compute 3 ** 1e9 as a Python integer)."""
import faulthandler
import json
import shutil

import h5py
import pytest
import torch
from click.testing import CliRunner

import upd
from upd.cli.main import main
from upd.replay import hparams
from upd.runfile import schema

from tests.harness.paths import SAMPLE_DIR

HPARAMS = schema.RECORD_TABLE.at(schema.HPARAMS, k=0)
STEP_COUNTER = schema.PARAMETER.at(schema.STATE_GROUP, k=0, name="fc1.weight") + "/step"
HANG_SECONDS = 120  # a regression to the unbounded power kills the run with a stack dump instead of hanging CI


def crafted(tmp_path, *, betas=None, lr=None, step_counter=None, raw_lr=None, **fields):
    path = str(tmp_path / "run.h5")
    shutil.copy(f"{SAMPLE_DIR}/adam.h5", path)
    with h5py.File(path, "r+") as f:
        rows = f[HPARAMS].asstr()[()]
        for i, row in enumerate(rows):
            groups = json.loads(row)
            for group in groups:
                if betas is not None:
                    group["betas"] = betas
                if lr is not None:
                    group["lr"] = lr
                group.update(fields)
            text = json.dumps(groups)
            if raw_lr is not None:  # a number json.dumps cannot write (1e400)
                text = text.replace('"lr": 0.001', f'"lr": {raw_lr}')
            f[HPARAMS][i] = text
        if step_counter is not None:
            f[STEP_COUNTER][1:] = step_counter
    return path


def verify(path):
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        result = CliRunner().invoke(main, ["verify", path])
    finally:
        faulthandler.cancel_dump_traceback_later()
    return result.exit_code, result.stdout, result.stderr


CASES = [
    ("integer beta1 and a step counter of 1e9", dict(betas=[3, 0.999], step_counter=1e9), "state 'step'"),
    ("integer beta1 out of range", dict(betas=[3, 0.999]), "betas[0]"),
    ("string betas", dict(betas=["a", "b"]), "betas[0]"),
    ("three betas", dict(betas=[0.9, 0.99, 0.999]), "betas"),
    ("a step counter past the run's steps", dict(step_counter=1e6), "state 'step'"),
    ("a fractional step counter", dict(step_counter=2.5), "state 'step'"),
    ("a string lr", dict(lr="0.1"), "lr"),
    ("a list lr", dict(lr=[0.1, 0.2]), "lr"),
    ("lr = 10**4000", dict(lr=10 ** 4000), "lr"),
    ("lr = 1e400 (infinite)", dict(raw_lr="1e400"), "lr"),
    ("a boolean beta", dict(betas=[True, 0.999]), "betas[0]"),
    # numbers of the right kind in a range torch refuses (before: exit 1, a MISMATCH blamed on the run)
    ("a negative eps", dict(eps=-1e-8), "eps"),
    ("a negative weight_decay", dict(weight_decay=-0.1), "weight_decay"),
]


@pytest.mark.parametrize("what, changes, field", CASES, ids=[c[0] for c in CASES])
def test_bad_hyperparameters_are_the_files_fault(tmp_path, what, changes, field):
    path = crafted(tmp_path, **changes)
    code, out, err = verify(path)
    assert code == 2, (what, code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and path in lines[0] and field in lines[0], err
    assert "UPD_DEBUG" not in err and "replay rule" not in err, err  # the file's fault, not the rule's


def test_the_untouched_file_still_verifies(tmp_path):
    """The checks refuse only what is wrong: the same file, rewritten but unchanged, matches (exit 0)."""
    code, out, err = verify(crafted(tmp_path, betas=[0.9, 0.999]))
    assert code == 0, out + err


def test_a_negative_lr_set_during_training_verifies(tmp_path):
    """torch checks lr >= 0 only in the constructor: a run whose lr went below zero later (a schedule, a change by
    hand) trained with it, and is verified as it ran, not refused as a broken file."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(tmp_path / "ascent.h5", model, opt, every=1):
        for step in range(3):
            opt.param_groups[0]["lr"] = 1e-2 if step == 0 else -1e-2
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    code, out, err = verify(str(tmp_path / "ascent.h5"))
    assert code == 0 and "6 step-parameter checks matched" in out, out + err


def test_values_are_converted_as_torch_takes_them():
    group = hparams.checked_group({"lr": 1, "betas": [0, 0.5], "eps": [None, 1], "weight_decay": 0,
                                   "maximize": False, "adjust_lr_fn": "original"})
    assert group == {"lr": 1.0, "betas": (0.0, 0.5), "eps": (None, 1.0), "weight_decay": 0.0, "maximize": False,
                     "adjust_lr_fn": "original"}
    assert all(type(v) is float for v in (group["lr"], *group["betas"], group["weight_decay"]))
    with pytest.raises(hparams.BadHyperparameter, match="maximize"):
        hparams.checked_group({"maximize": "false"})  # bool("false") would be True
    with pytest.raises(hparams.BadHyperparameter, match="ns_steps"):
        hparams.checked_group({"ns_steps": 10 ** 9})
    for bad, field in (({"momentum": -0.9}, "momentum"), ({"rho": 1.5}, "rho"), ({"d": 0.5}, "d"),
                       ({"beta2_decay": 0.8}, "beta2_decay"), ({"eps": [None, -1e-3]}, "eps[1]"),
                       ({"lr_decay": -1}, "lr_decay"), ({"etas": [0.5, 0.9]}, "etas")):
        with pytest.raises(hparams.BadHyperparameter, match=rf"^{field.replace('[', '.')} .*torch refuses"):
            hparams.checked_group(bad)  # outside the range torch's constructors accept (hparams.RANGES)
    assert hparams.checked_group({"lr": 0, "momentum": 0, "rho": 1, "d": 1, "beta2_decay": -0.8}) == \
        {"lr": 0.0, "momentum": 0.0, "rho": 1.0, "d": 1.0, "beta2_decay": -0.8}  # the bounds themselves pass
    hparams.check_step_counters([0, 3, 19], 19)
    for bad in ([20], [-1], [float("nan")], [1.5]):
        with pytest.raises(hparams.BadHyperparameter):
            hparams.check_step_counters(bad, 19)
