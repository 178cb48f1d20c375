"""What a new user meets at the edges of the commands: Ctrl-C, a second run given to analyze."""
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from upd.cli.main import main
from upd.exit_codes import EXIT_INTERRUPTED, EXIT_UNUSABLE

from tests.harness.paths import SAMPLE_RUNS


def test_analyze_given_two_runs_points_to_compare():
    result = CliRunner().invoke(main, ["analyze", SAMPLE_RUNS[0], SAMPLE_RUNS[1]])
    assert result.exit_code == EXIT_UNUSABLE
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "upd compare RUN RUN" in lines[0], result.output


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line(tmp_path):
    """SIGINT to a real `upd demo` while it trains: exit 130 (not 1, verify's "mismatch"), one line, no traceback."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "upd", "demo", "--out", str(tmp_path), "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        proc.stdout.readline()  # training has started
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, err)
    assert err.strip() == "upd: interrupted" and "Aborted" not in err, err
