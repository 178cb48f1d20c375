"""`upd analyze` and `upd compare` options as a user types them: checked before the work, folders created, one
error line and exit 2 for a bad option."""
import subprocess
import sys

import pytest
from click.testing import CliRunner

import upd.cli.analyze as analyze_cli
from upd.cli.main import main

from tests.harness.analysis_runs import record_deep
from tests.harness.paths import SAMPLE_RUNS

ADAM = [p for p in SAMPLE_RUNS if p.endswith("/adam.h5")][0]
SGD = [p for p in SAMPLE_RUNS if p.endswith("/sgd_momentum.h5")][0]


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the analysis itself runs: for options that must be refused before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the analysis ran before the options were checked")
    monkeypatch.setattr(analyze_cli, "analyze_run", refuse)


@pytest.mark.parametrize("step", ["999", "-1", "20"])
def test_a_step_without_a_record_exits_2_with_the_valid_range(step, tmp_path):
    code, out = run_cli("analyze", ADAM, "--step", step, "--out", tmp_path / "o")
    assert code == 2 and out.count("\n") == 1
    assert f"step {step}" in out and "steps 0..19" in out
    assert not list((tmp_path / "o").glob("*.png"))


@pytest.mark.slow
def test_a_recorded_step_draws_its_histograms(tmp_path):
    code, out = run_cli("analyze", ADAM, "--step", "7", "--out", tmp_path / "o")
    assert code == 0 and (tmp_path / "o" / "grad_histograms.png").exists()
    assert "histograms at step 7, from the full-tensor records (steps 0..19)" in out


def test_no_plots_with_out_still_writes_the_summary(tmp_path):
    out = tmp_path / "only-table"
    code, text = run_cli("analyze", ADAM, "--no-plots", "--out", out)
    assert code == 0 and sorted(p.name for p in out.iterdir()) == ["summary.csv"]
    assert "summary.csv in" in text
    code, _ = run_cli("analyze", ADAM, "--no-plots")  # no --out, no plots: nothing written
    assert code == 0


def test_csv_and_html_create_their_folders_like_out(tmp_path):
    csv, html = tmp_path / "new" / "deeper" / "ratios.csv", tmp_path / "other" / "report.html"
    code, out = run_cli("analyze", ADAM, "--no-plots", "--csv", csv, "--html", html)
    assert code == 0, out
    assert len(csv.read_text().splitlines()) == 1 + 20 * 4
    assert "<!DOCTYPE html>" in html.read_text() and "data:image" not in html.read_text()  # --no-plots: none
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out = run_cli("analyze", ADAM, "--no-plots", "--csv", blocker / "x.csv")
    assert code == 2 and out.count("\n") == 1 and "--csv" in out


def test_tensorboard_without_the_package_fails_before_the_work(monkeypatch, no_work, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what a missing package looks like
    code, out = run_cli("analyze", ADAM, "--tensorboard", tmp_path / "tb")
    assert code == 2 and out.count("\n") == 1 and 'pip install ".[tensorboard]"' in out


def test_bad_thresholds_fail_before_the_work(no_work):
    code, out = run_cli("analyze", ADAM, "--high", "-5", "--low", "-4")
    assert code == 2 and "must be below" in out


def test_the_table_says_its_first_column_is_the_last_step():
    code, out = run_cli("analyze", ADAM, "--no-plots")
    top, bottom = out.split("\n\n")[1].splitlines()[:2]  # after the findings; the header in two lines (100 columns)
    ends = [i + len("(last step)") for i in range(len(bottom)) if bottom.startswith("(last step)", i)]
    assert [top.index(w) + len(w) for w in ("update:data", "grad:data")] == ends  # right-aligned over its column
    assert "(median)" in bottom


@pytest.mark.slow
def test_html_report_with_verify(tmp_path):
    html = tmp_path / "report.html"
    code, out = run_cli("analyze", ADAM, "--html", html, "--verify", "--out", tmp_path / "plots")
    assert code == 0, out
    assert "verify: " in out and "80 step-parameter checks matched" in out
    text = html.read_text()
    assert text.count("data:image/png;base64,") == 4 and "80 step-parameter checks matched" in text


@pytest.mark.slow
def test_statistics_mode_names_the_histogram_steps_in_model_order(tmp_path):
    path = record_deep(tmp_path / "stats.h5", n_layers=11, steps=6, every=3, stats_every=1)
    code, out = run_cli("analyze", path, "--out", tmp_path / "o")
    assert code == 0, out
    assert "histograms at steps 0, 3, from the full-tensor records" in out
    names = [line.split()[0] for line in out.splitlines()[1:] if line.split() and "." in line.split()[0]]
    assert names.index("2.weight") < names.index("10.weight")


@pytest.mark.slow
def test_an_all_nan_run_prints_no_third_party_warning(tmp_path):
    from tests.analyzer.test_plots import _nan_run

    path = _nan_run(str(tmp_path / "nan.h5"))
    proc = subprocess.run([sys.executable, "-m", "upd", "analyze", path, "--all-params", "--html",
                           str(tmp_path / "r.html")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "nothing to judge" in proc.stdout


@pytest.mark.slow
def test_compare_prints_the_side_by_side_table_and_writes_figures(tmp_path):
    out = tmp_path / "cmp"
    code, text = run_cli("compare", ADAM, SGD, "--out", out)
    assert code == 0, text
    assert "adam" in text and "sgd_momentum - adam" in text and "fc1.weight" in text
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare_grad_to_data.png",
                                                     "compare_update_to_data.png"]
    code, text = run_cli("compare", ADAM, SGD, "--no-plots", "--label", "A", "--label", "B",
                         "--quantity", "grad_to_data")
    assert code == 0 and "B - A" in text and "median grad:data" in text


@pytest.mark.parametrize("args, words", [
    ([ADAM], "at least two runs"),
    ([ADAM, SGD, "--label", "x"], "one per run"),
    ([ADAM, SGD, "--label", "x", "--label", "x"], "must differ"),
])
def test_compare_bad_calls_one_line_exit_2(args, words):
    code, out = run_cli("compare", *args)
    assert code == 2 and out.count("\n") == 1 and words in out
