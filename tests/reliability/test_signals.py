"""SIGTERM, SIGINT and a plain interpreter exit close the run cleanly, without swallowing the user's handling."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import pytest

import upd

TRAIN = textwrap.dedent("""
    import os, signal, sys, time, torch, upd
    # A shell's background jobs inherit SIGINT ignored; give the child the interactive default (KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import faulthandler; faulthandler.dump_traceback_later(45, exit=True)  # a hang shows where, then fails
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = sys.argv[2]
    if mode == "user-handler":
        def handler(signum, frame):
            open(sys.argv[1] + ".user", "w").write("called")
            sys.exit(7)
        signal.signal(signal.SIGTERM, handler)
    rec = upd.record(sys.argv[1], model, opt)          # no `with`: the exit paths must close it
    for step in range(100000):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        if step == 5:
            print("ready", flush=True)
        if mode == "exit" and step == 9:
            sys.exit(0)                                  # leaves without rec.close()
        time.sleep(0.01)
""")


def run_and_signal(tmp_path, mode, sig=None):
    path = str(tmp_path / "run.h5")
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, path, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    if sig is not None:
        time.sleep(0.05)
        proc.send_signal(sig)
        if sig == signal.SIGINT:
            # Python swallows a KeyboardInterrupt that lands in a weakref callback or __del__ ("Exception ignored
            # in ..."), with or without torch-upd; a user presses Ctrl-C again, and so do we.
            for _ in range(5):
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    proc.send_signal(sig)
    code = proc.wait(timeout=90)
    err = proc.stderr.read()
    assert "Timeout" not in err, err
    return path, code


def closed_cleanly(path):
    with h5py.File(path, "r") as f:
        return f.attrs.get("closed_cleanly") == "true"


def test_sigterm_closes_and_still_terminates(tmp_path):
    path, code = run_and_signal(tmp_path, "plain", signal.SIGTERM)
    assert code == -signal.SIGTERM  # the default action still happened
    assert closed_cleanly(path)
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records >= 6
    assert upd.verify(path).exit_code == 0


def test_users_sigterm_handler_still_runs(tmp_path):
    path, code = run_and_signal(tmp_path, "user-handler", signal.SIGTERM)
    assert code == 7 and open(path + ".user").read() == "called"
    assert closed_cleanly(path)


def test_sigint_closes_cleanly(tmp_path):
    path, code = run_and_signal(tmp_path, "plain", signal.SIGINT)
    assert code != 0  # KeyboardInterrupt, as without torch-upd
    assert closed_cleanly(path)


def test_plain_exit_without_close(tmp_path):
    path, code = run_and_signal(tmp_path, "exit")
    assert code == 0 and closed_cleanly(path)
    assert upd.open_run(path).optimizers[0].num_records == 10
