"""A check that cannot tell the recorded update from none is inconclusive, not a pass; a run whose steps have no full
record says why nothing (or little) was checked."""
import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import upd
from upd.cli.main import main as cli
from upd.replay.engine import EXIT_MATCH, EXIT_NOTHING_VERIFIABLE

from tests.harness.training import record_run


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_bfloat16_storage_of_small_adam_updates_is_inconclusive_not_ok(tmp_path):
    # Adam moves each weight by about lr = 1e-3 of a weight of size ~0.1-1: below bfloat16's spacing (2^-8
    # relative). Every check passes its tolerance, and none could have caught a missing update.
    path = record_run(str(tmp_path / "bf16.h5"), _adamw, steps=4, dtype="bfloat16")
    report = upd.verify(path)
    assert report.mismatched == 0 and report.matched == 0 and report.inconclusive == 4 * 4, report.summary()
    assert report.exit_code == EXIT_NOTHING_VERIFIABLE
    assert (report.checks["update_resolved"] < 0.5).all()
    assert set(report.by_param()["result"]) == {"inconclusive"}
    assert "16 inconclusive" in report.summary() and "verify nothing" in report.summary()
    assert all("inconclusive" in note for note in report.precision_notes)

    result = CliRunner().invoke(cli, ["verify", "--json", path])
    assert result.exit_code == EXIT_NOTHING_VERIFIABLE
    out = json.loads(result.output)
    assert out["inconclusive"] == 16 and out["matched"] == 0
    assert {p["result"] for p in out["params"]} == {"inconclusive"}


def test_the_same_run_stored_in_float32_is_conclusive(tmp_path):
    path = record_run(str(tmp_path / "f32.h5"), _adamw, steps=4)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH and report.matched == 16 and report.inconclusive == 0
    assert (report.checks["update_resolved"] > 0.9).all()


def test_an_lr_below_float32_precision_is_inconclusive(tmp_path):
    path = record_run(str(tmp_path / "tiny_lr.h5"), lambda m: torch.optim.SGD(m.parameters(), lr=1e-12), steps=3)
    report = upd.verify(path)
    assert report.matched == 0 and report.inconclusive == 12 and report.exit_code == EXIT_NOTHING_VERIFIABLE
    assert report.checks["note"].str.contains("an update missing or wrong on those elements would pass too").all()


def test_a_statistics_only_run_says_why_nothing_was_checked(tmp_path):
    path = record_run(str(tmp_path / "stats.h5"), _adamw, steps=5, every=None, stats_every=1)
    report = upd.verify(path)
    assert report.exit_code == EXIT_NOTHING_VERIFIABLE
    assert any("none of its 5 recorded steps has a full record" in p for p in report.problems), report.problems
    result = CliRunner().invoke(cli, ["verify", "--json", path])
    assert result.exit_code == EXIT_NOTHING_VERIFIABLE
    assert any("statistics" in p for p in json.loads(result.output)["problems"])


def test_a_run_with_few_full_records_says_how_many_steps_were_checkable(tmp_path):
    path = record_run(str(tmp_path / "sparse.h5"), _adamw, steps=10, every=5, stats_every=1)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH and report.matched == 2 * 4
    assert any("2 of its 10 recorded steps have full records" in p and "other 8 have statistics only" in p
               for p in report.problems), report.problems
    # every step recorded in full: nothing to say
    full = upd.verify(record_run(str(tmp_path / "full.h5"), _adamw, steps=3))
    assert full.problems == []


def test_first_mismatch_step_is_an_integer(tmp_path):
    import h5py
    from upd.runfile import schema
    path = record_run(str(tmp_path / "run.h5"), _adamw, steps=5)
    with h5py.File(path, "r+") as f:
        ds = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name="fc2.weight")]
        ds[3] = ds[3] * 1.5
    table = upd.verify(path).by_param()
    assert str(table["first_mismatch_step"].dtype) == "Int64"
    assert table.set_index("param")["first_mismatch_step"].to_dict()["fc2.weight"] == 3
    result = CliRunner().invoke(cli, ["verify", path])
    row = next(line for line in result.output.splitlines() if line.strip().startswith("fc2.weight"))
    assert " 3 " in row and "3.0" not in row


LION = '''
import torch
import upd


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_((group["beta"] * m + (1 - group["beta"]) * p.grad).sign(), alpha=-group["lr"])
                m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])


@upd.replay.register(Lion, state={"exp_avg": upd.replay.zeros})
def lion(param, grad, state, group, step):
    m, b = state["exp_avg"], group["beta"]
    new_m = b * m + (1 - b) * grad
    return upd.replay.Replayed(param - group["lr"] * new_m.sign(), {"exp_avg": new_m})
'''


@pytest.mark.slow
def test_rules_module_in_the_current_directory_loads_from_the_console_script(tmp_path, monkeypatch):
    (tmp_path / "lion_opt.py").write_text(LION)
    monkeypatch.syspath_prepend(str(tmp_path))
    import lion_opt
    path = record_run(str(tmp_path / "lion.h5"), lambda m: lion_opt.Lion(m.parameters()), steps=3)
    upd.replay.unregister(lion_opt.Lion)  # the CLI processes below load it themselves
    script = os.path.join(os.path.dirname(sys.executable), "upd")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The console script alone: `python -m upd` puts the current directory on sys.path itself, so it would load
    # the module even without the CLI's own insertion (upd/cli/verify.py) and could not fail here.
    ok = subprocess.run([script, "verify", path, "--rules", "lion_opt"], cwd=tmp_path, env=env, capture_output=True,
                        text=True)
    assert ok.returncode == EXIT_MATCH, ok.stdout + ok.stderr
    # the control, once: without --rules the same command cannot verify a Lion run
    without = subprocess.run([script, "verify", path], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert without.returncode == EXIT_NOTHING_VERIFIABLE, without.stdout + without.stderr
