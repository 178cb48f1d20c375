"""What a new user meets at the edges of the commands: Ctrl-C, a second run given to analyze."""
import contextlib
import io
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
    # Started as an interactive shell starts a command, whatever this test process inherited: a suite started in the
    # background by a non-interactive shell (`pytest ... &`, as CI runners may) has SIGINT and SIGQUIT ignored, and
    # a Python child born with SIGINT ignored keeps it ignored and trains on (60 s, then this test failed).
    proc = subprocess.Popen([sys.executable, "-m", "upd", "demo", "--out", str(tmp_path), "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdout.readline()  # training has started
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, err)
    assert err.strip() == "upd: interrupted" and "Aborted" not in err, err


def _run_in_this_process(args, stderr):
    """`upd ARGS` in this process (the bar's choice is stderr's isatty(), nothing of a process of its own), its
    stderr the file object `stderr`, stdout captured: (exit code, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(stderr):
        try:
            main(args, prog_name="upd")
            code = 0
        except SystemExit as exc:
            code = exc.code
    stderr.flush()
    return code, out.getvalue()


def _reading(fd):
    """A thread that reads `fd` until the other side closes: (thread, the chunks it read)."""
    got = []

    def read():
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the other side closed
                return
            if not chunk:
                return
            got.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, got


def _run(args, terminal: bool):
    """`upd ARGS` with stderr a pseudo-terminal, or a pipe: (exit code, stdout, what stderr got)."""
    if terminal:
        master, slave = pty.openpty()
        read_end, write_end = master, slave
    else:
        read_end, write_end = os.pipe()
    reader, got = _reading(read_end)
    try:
        with open(write_end, "w", closefd=False) as stderr:
            assert stderr.isatty() == terminal
            code, stdout = _run_in_this_process(args, stderr)
    finally:
        os.close(write_end)
        reader.join(timeout=10)
        os.close(read_end)
    return code, stdout, b"".join(got).decode()


@pytest.mark.slow
def test_progress_on_a_terminal_and_nothing_when_piped(tmp_path):
    """The commands' own code in this process, stderr a real pseudo-terminal or a real pipe (a process of its own
    per command cost seconds each importing torch; that `python -m upd` runs the commands is
    tests/cli/test_cli.py::test_console_script_runs_as_a_user_would)."""
    adam = [p for p in SAMPLE_RUNS if p.endswith("/adam.h5")][0]
    analyze = ["analyze", adam, "--no-plots", "--html", str(tmp_path / "r.html"), "--verify"]
    outputs = {}
    for args, labels in ((["verify", adam], ["verifying ["]), (analyze, ["computing the ratios", "verifying ["])):
        code, outputs[args[0]], terminal = _run(args, terminal=True)
        assert code == 0, terminal
        for label in labels:
            assert label in terminal, (args, terminal)
        assert terminal.endswith("\r\x1b[K")  # the bar is cleared: the output continues on a clean line
    code, stdout, piped = _run(["verify", adam], terminal=False)
    assert code == 0 and piped == ""  # piped: not one character of progress
    assert outputs["verify"] == stdout  # stdout the same either way


def test_main_help_lists_each_command_whole_and_the_interrupted_code():
    out = CliRunner().invoke(main, ["--help"]).output
    commands = out.split("Commands:")[1].split("Exit codes:")[0]
    assert "..." not in commands and len([line for line in commands.splitlines() if line.strip()]) == len(COMMANDS)
    assert "130  interrupted (Ctrl-C)" in out
