"""`upd verify` on mixed-precision runs: a fused optimizer under torch.amp.GradScaler is handed the scaled gradients
and the scale, and skips a step itself when the scaler found an inf/NaN; both replay as the optimizer did them."""
import h5py
import json

import pytest
from click.testing import CliRunner

import upd
from upd.cli.main import main
from upd.replay import skipped_steps
from upd.replay.engine import EXIT_MATCH, EXIT_MISMATCH
from upd.runfile import schema

from tests.harness.grad_scaler import train

INF_STEPS = (0, 2)  # the first step too: the optimizer creates its state and counts no step


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_verify_matches_every_step_with_and_without_unscale(tmp_path, fused):
    for unscale in (False, True):
        path = train(str(tmp_path / f"run-{unscale}.h5"), scaler=True, fused=fused, unscale=unscale,
                     inf_steps=INF_STEPS, steps=5, every=1)
        report = upd.verify(path)
        assert report.exit_code == EXIT_MATCH, report.summary()
        checks = report.checks
        # the foreach optimizer is never stepped at a skipped step: GradScaler skips optimizer.step() itself
        assert set(checks.step) == ({0, 1, 2, 3, 4} if fused else {0, 1, 2})
        assert (checks.status == "match").all(), checks
        skipped = checks[checks.note == skipped_steps.NOTE]
        assert set(skipped.step) == (set(INF_STEPS) if fused else set()), checks.note.tolist()


def _set_found_inf(path, step, value):
    with h5py.File(path, "r+") as f:
        table = f["optimizers/0"][schema.SCALARS]
        column = json.loads(table.attrs[schema.SCALAR_COLUMNS]).index(schema.SCALAR_AMP_FOUND_INF)
        row = list(table[schema.STEP][:]).index(step)
        table[schema.VALUES][row, column] = value


@pytest.mark.slow
def test_the_cli_exits_0_and_a_wrong_found_inf_mismatches(tmp_path):
    path = train(str(tmp_path / "run.h5"), scaler=True, fused=True, inf_steps=(1,), steps=3, every=1)
    result = CliRunner().invoke(main, ["verify", path], catch_exceptions=False)
    assert result.exit_code == EXIT_MATCH, result.output
    # A skipped step replayed with the optimizer's math instead (what verify did before it read amp_found_inf):
    # the parameter did not move, the replay moves it.
    _set_found_inf(path, 1, 0.0)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    assert set(report.checks[report.checks.status == "mismatch"].step) == {1}
    # A step that did move, marked skipped: replayed as no change, it mismatches too.
    _set_found_inf(path, 1, 1.0)
    _set_found_inf(path, 2, 1.0)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    assert set(report.checks[report.checks.status == "mismatch"].step) == {2}
