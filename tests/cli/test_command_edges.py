"""What a new user meets at the edges of the commands: Ctrl-C, a second run given to analyze."""
import os
import pty
import signal
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from upd.cli.main import COMMANDS, main
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


def _run_with_stderr_on_a_terminal(args):
    """`python -m upd ARGS` with stderr a pseudo-terminal (stdout a pipe): (exit code, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    got = []

    def read():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the other side closed
                return
            if not chunk:
                return
            got.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "upd", *args], stdout=subprocess.PIPE, stderr=slave,
                              text=True, timeout=300)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    return proc.returncode, proc.stdout, b"".join(got).decode()


@pytest.mark.slow
def test_progress_on_a_terminal_and_nothing_when_piped(tmp_path):
    adam = [p for p in SAMPLE_RUNS if p.endswith("/adam.h5")][0]
    analyze = ["analyze", adam, "--no-plots", "--html", str(tmp_path / "r.html"), "--verify"]
    outputs = {}
    for args, labels in ((["verify", adam], ["verifying ["]), (analyze, ["computing the ratios", "verifying ["])):
        code, outputs[args[0]], terminal = _run_with_stderr_on_a_terminal(args)
        assert code == 0, terminal
        for label in labels:
            assert label in terminal, (args, terminal)
        assert terminal.endswith("\r\x1b[K")  # the bar is cleared: the output continues on a clean line
    piped = subprocess.run([sys.executable, "-m", "upd", "verify", adam], capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0 and piped.stderr == ""  # piped: not one character of progress
    assert outputs["verify"] == piped.stdout  # stdout the same either way


def test_main_help_lists_each_command_whole_and_the_interrupted_code():
    out = CliRunner().invoke(main, ["--help"]).output
    commands = out.split("Commands:")[1].split("Exit codes:")[0]
    assert "..." not in commands and len([line for line in commands.splitlines() if line.strip()]) == len(COMMANDS)
    assert "130  interrupted (Ctrl-C)" in out
