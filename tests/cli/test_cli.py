"""The `upd` command as a user runs it: real subprocesses for exit codes and output, CliRunner for speed."""
import json
import subprocess
import sys

import h5py
import pytest
from click.testing import CliRunner

from upd.cli.main import main
from upd.runfile import schema

from tests.harness.paths import SAMPLE_RUNS

ADAM = [p for p in SAMPLE_RUNS if p.endswith("/adam.h5")][0]


def run_cli(*args):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.parametrize("command", [[], ["info"], ["analyze"], ["verify"], ["demo"]])
def test_every_help_reads(command):
    code, out = run_cli(*command, "--help")
    assert code == 0
    assert "Usage: main" in out or "Usage: upd" in out
    if command:
        assert len(out.splitlines()) > 5


def test_main_help_documents_exit_codes():
    code, out = run_cli("--help")
    for line in ("0  success", "1  verify", "2  unusable input", "3  verify: nothing verifiable"):
        assert line in out


@pytest.mark.slow
def test_console_script_runs_as_a_user_would(tmp_path):
    """The installed `upd` entry point: analyze a non-HDF5 file -> exactly one line on stderr and exit 2."""
    bad = tmp_path / "notes.txt"
    bad.write_text("not a run\n")
    proc = subprocess.run([sys.executable, "-m", "upd", "analyze", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["info", "analyze", "verify"])
def test_bad_inputs_one_line_exit_2(tmp_path, command):
    other_hdf5 = tmp_path / "other.h5"
    with h5py.File(other_hdf5, "w") as f:
        f["x"] = [1, 2, 3]
    empty = tmp_path / "empty.h5"
    empty.write_bytes(b"")
    for path, words in ((tmp_path / "missing.h5", "no such file"), (tmp_path, "directory"),
                        (other_hdf5, "not a torch-upd run"), (empty, "empty")):
        result = CliRunner().invoke(main, [command, str(path)])
        assert result.exit_code == 2, (command, path, result.output)
        assert words in result.output and result.output.count("\n") == 1
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_info_lists_optimizer_groups_and_params():
    code, out = run_cli("info", [p for p in SAMPLE_RUNS if "adamw" in p][0])
    assert code == 0
    assert "torch.optim.AdamW, 2 param group(s), 20 full-tensor records (steps 0..19), 0 statistics steps" in out
    assert "fc1.weight" in out and "20x64" in out and "exp_avg_sq" in out
    code, out = run_cli("info", "--json", ADAM)
    desc = json.loads(out)
    assert desc["format_version"] == 1 and desc["optimizers"][0]["records"] == 20


def test_analyze_writes_plots_tables_and_flags(tmp_path):
    out_dir = tmp_path / "analysis"
    csv = tmp_path / "ratios.csv"
    code, out = run_cli("analyze", ADAM, "--out", str(out_dir), "--csv", str(csv))
    assert code == 0
    for png in ("update_to_data.png", "grad_to_data.png", "grad_histograms.png", "weight_histograms.png"):
        assert (out_dir / png).stat().st_size > 10_000
    assert (out_dir / "summary.csv").exists()
    assert len(csv.read_text().splitlines()) == 1 + 20 * 4
    assert "fc1.weight" in out and "all weights within [-4.5, -1.5]" in out
    # Tight thresholds flag the weights, and say how.
    code, out = run_cli("analyze", ADAM, "--no-plots", "--high", "-3.5", "--low", "-3.6")
    assert code == 0 and "HIGH" in out and "weight(s) outside [-3.6, -3.5]" in out
    code, out = run_cli("analyze", ADAM, "--no-plots", "--high", "-5", "--low", "-4")
    assert code == 2 and "must be below" in out


def test_analyze_never_wipes_an_output_folder(tmp_path):
    out_dir = tmp_path / "analysis"
    out_dir.mkdir()
    (out_dir / "mine.txt").write_text("keep me")
    assert run_cli("analyze", ADAM, "--out", str(out_dir))[0] == 0
    assert (out_dir / "mine.txt").read_text() == "keep me"


def test_verify_exit_codes_and_json(tmp_path, sample_copy):
    code, out = run_cli("verify", ADAM)
    assert code == 0 and "80 step-parameter checks matched, 0 mismatched" in out
    path = sample_copy("adam.h5")
    with h5py.File(path, "r+") as f:
        ds = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name='fc2.weight')]
        ds[3] = ds[3] * 1.01
    code, out = run_cli("verify", path)
    assert code == 1 and "MISMATCH fc2.weight step 3" in out
    code, out = run_cli("verify", "--json", path)
    report = json.loads(out)
    assert code == 1 and report["exit_code"] == 1 and report["mismatched"] == 1
    assert [p["first_mismatch_step"] for p in report["params"] if p["param"] == "fc2.weight"] == [3]


@pytest.mark.slow
@pytest.mark.parametrize("init, flagged", [("good", False), ("bad", True)])
def test_demo_leaves_plots_and_tables(tmp_path, init, flagged):
    out = tmp_path / "demo"
    code, text = run_cli("demo", "--out", str(out), "--steps", "40", "--init", init)
    assert code == 0, text
    analysis = out / f"analysis-{init}"
    for name in ("update_to_data.png", "grad_to_data.png", "grad_histograms.png", "weight_histograms.png",
                 "summary.csv", "ratios.csv"):
        assert (analysis / name).stat().st_size > 500, name
    assert "checks matched, 0 mismatched" in text
    # The bad init's hidden weights move by percents per step: flagged HIGH; the good init's are not.
    assert ("HIGH" in text) == flagged
    # A second demo into the same folder is refused unless --force.
    code, text = run_cli("demo", "--out", str(out), "--steps", "5", "--init", init)
    assert code == 2 and "--force" in text


@pytest.mark.parametrize("option", ["--rtol", "--ulps"])
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_verify_refuses_a_negative_or_nan_tolerance(option, value):
    result = CliRunner().invoke(main, ["verify", option, value, ADAM])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and option.lstrip("-") in result.output
    assert run_cli("verify", option, "0", ADAM)[0] != 2  # zero is a tolerance, if a strict one


def test_verify_exit_4_when_a_replay_rule_fails(tmp_path, monkeypatch):
    """A rule that raises (its own bug) is reported as such: exit 4 and one line naming the rule, step and param."""
    module = tmp_path / "broken_rules.py"
    module.write_text("import torch, upd\n\n"
                      "@upd.replay.register(torch.optim.Adam, torch_below='99')\n"
                      "def divides_by_zero(param, grad, state, group, step):\n"
                      "    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import upd
    try:
        result = CliRunner().invoke(main, ["verify", "--rules", "broken_rules", ADAM])
    finally:
        upd.replay.registry._RULES["torch.optim.Adam"] = [
            r for r in upd.replay.registry._RULES["torch.optim.Adam"] if r.fn.__name__ != "divides_by_zero"]
        sys.modules.pop("broken_rules", None)
    assert result.exit_code == 4, result.output
    assert result.output.count("\n") == 1
    assert "broken_rules.divides_by_zero" in result.output and "ZeroDivisionError" in result.output
    assert "step 0" in result.output and "parameter" in result.output
    assert run_cli("verify", ADAM)[0] == 0


def test_main_help_documents_exit_code_4():
    assert "4  verify: a replay rule failed" in run_cli("--help")[1]


@pytest.mark.parametrize("args, words", [
    (["analyze", "--bogus", "x.h5"], "No such option '--bogus'"),
    (["verify"], "Missing argument 'RUN'"),
    (["nosuch"], "No such command 'nosuch'"),
    (["analyze", "--high", "abc", "x.h5"], "'abc' is not a valid float"),
])
def test_a_usage_error_is_one_line_with_where_to_look(args, words):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("upd: error: ") and words in lines[0], result.output
    assert "--help'" in lines[0] and "Usage:" not in result.output
