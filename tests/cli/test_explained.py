"""What the commands print is explained where it is printed: verify's err/tol and err/update in its --help, and the
demo's next steps lead on (compare the two runs once both exist) instead of writing the analysis just written
elsewhere."""
import os

from click.testing import CliRunner

from upd.cli.demo import next_steps
from upd.cli.main import main


def test_verify_help_explains_its_error_columns():
    text = " ".join(CliRunner().invoke(main, ["verify", "--help"]).output.split())
    for column in ("err/tol: the worst error over the parameter's checks divided by",
                   "err/update: the worst error divided by the largest recorded update"):
        assert column in text, column


def test_the_demos_next_steps_lead_to_compare_once_both_runs_exist(tmp_path):
    out = str(tmp_path)
    good, bad = os.path.join(out, "demo-good.h5"), os.path.join(out, "demo-bad.h5")
    first = next_steps(out, "good", good, os.path.join(out, "analysis-good"))
    assert first[0].startswith(f"upd demo --init bad --out {out}") and "compare" in first[0]
    open(good, "wb").close()  # the good run exists when the bad one is made
    second = next_steps(out, "bad", bad, os.path.join(out, "analysis-bad"))
    assert second[0].startswith(f"upd compare {good} {bad} --out {os.path.join(out, 'compare')}")
    for line in first + second:  # an analysis is suggested into the folder the demo wrote, never a second copy
        if line.startswith("upd analyze"):
            assert "--out " + os.path.join(out, "analysis-") in line
