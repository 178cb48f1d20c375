"""Only a path the user typed is followed, and no output replaces an input (upd/outputs.py).

Before: `run-analysis -> elsewhere` shipped next to `run.h5` had `upd analyze run.h5` write summary.csv and four PNGs
into `elsewhere`, replacing a file there (`upd compare` through `run-compare` the same); and `upd analyze run.h5
--csv run.h5` replaced the run with the CSV."""
import hashlib
import os
import shutil

from click.testing import CliRunner

from upd.cli.main import main

from tests.harness.paths import SAMPLE_DIR


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _run_and_elsewhere(tmp_path):
    run = str(tmp_path / "run.h5")
    shutil.copy(f"{SAMPLE_DIR}/adam.h5", run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "summary.csv").write_text("precious")
    (elsewhere / "compare.csv").write_text("precious")
    return run, elsewhere


def _one_line_refusal(result, *words):
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr and "UPD_DEBUG" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_a_symlinked_default_folder_is_never_followed(tmp_path):
    run, elsewhere = _run_and_elsewhere(tmp_path)
    other = str(tmp_path / "other.h5")
    shutil.copy(f"{SAMPLE_DIR}/adam.h5", other)
    os.symlink(elsewhere, tmp_path / "run-analysis")
    os.symlink(elsewhere, tmp_path / "run-compare")
    _one_line_refusal(CliRunner().invoke(main, ["analyze", run]), "run-analysis", "symbolic link", "--out")
    _one_line_refusal(CliRunner().invoke(main, ["compare", run, other]), "run-compare", "symbolic link", "--out")
    assert sorted(os.listdir(elsewhere)) == ["compare.csv", "summary.csv"]
    assert (elsewhere / "summary.csv").read_text() == "precious" == (elsewhere / "compare.csv").read_text()
    # a dangling link is not followed either (it would create the folder it names)
    os.remove(tmp_path / "run-analysis")
    os.symlink(tmp_path / "nowhere", tmp_path / "run-analysis")
    _one_line_refusal(CliRunner().invoke(main, ["analyze", run]), "symbolic link")
    assert not (tmp_path / "nowhere").exists()


def test_a_folder_the_user_typed_is_followed(tmp_path):
    """The same link given as --out is the user's choice: followed, as before."""
    run, elsewhere = _run_and_elsewhere(tmp_path)
    os.symlink(elsewhere, tmp_path / "mine")
    result = CliRunner().invoke(main, ["analyze", run, "--no-plots", "--out", str(tmp_path / "mine")])
    assert result.exit_code == 0, result.stderr
    assert (elsewhere / "summary.csv").read_text() != "precious"


def test_no_output_replaces_an_input(tmp_path):
    run, _ = _run_and_elsewhere(tmp_path)
    before = _digest(run)
    os.link(run, tmp_path / "same.h5")  # the run under another spelling of its path
    for args in (["--csv", run], ["--csv", os.path.join(str(tmp_path), ".", "run.h5")], ["--html", run],
                 ["--csv", str(tmp_path / "same.h5")]):
        _one_line_refusal(CliRunner().invoke(main, ["analyze", run, "--no-plots", *args]), "input file")
    # an --out folder that holds the input under an output's name
    summary_named = tmp_path / "out" / "summary.csv"
    summary_named.parent.mkdir()
    shutil.copy(run, summary_named)
    _one_line_refusal(CliRunner().invoke(main, ["analyze", str(summary_named), "--no-plots", "--out",
                                                str(summary_named.parent)]), "input file")
    assert _digest(run) == before == _digest(summary_named)


def test_no_figure_replaces_an_input(tmp_path):
    """The figures too: a run copied to out/update_to_data.png and analyzed with --out out was replaced by the
    figure (only --csv, --html and summary.csv were checked); compare's figures likewise."""
    run, _ = _run_and_elsewhere(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for command, name in ((["analyze"], "update_to_data.png"), (["compare", run], "compare_grad_to_data.png")):
        named = out / name
        shutil.copy(run, named)
        before = _digest(named)
        _one_line_refusal(CliRunner().invoke(main, [command[0], str(named), *command[1:], "--out", str(out)]),
                          "input file")
        assert _digest(named) == before, command
