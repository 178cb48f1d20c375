"""SIGTERM, SIGINT and a plain interpreter exit close the run cleanly, without swallowing the user's handling."""
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
    rec = upd.record(sys.argv[1], model, opt, every=1)        # no `with`: the exit paths must close it
    for step in range(100000):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        if step == 5:
            print("ready", flush=True)
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


@pytest.mark.slow
def test_sigterm_closes_and_still_terminates(tmp_path):
    path, code = run_and_signal(tmp_path, "plain", signal.SIGTERM)
    assert code == -signal.SIGTERM  # the default action still happened
    assert closed_cleanly(path)
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records >= 6
    assert upd.verify(path).exit_code == 0


@pytest.mark.slow
def test_users_sigterm_handler_still_runs(tmp_path):
    path, code = run_and_signal(tmp_path, "user-handler", signal.SIGTERM)
    assert code == 7 and open(path + ".user").read() == "called"
    assert closed_cleanly(path)


@pytest.mark.slow
def test_sigint_closes_cleanly(tmp_path):
    path, code = run_and_signal(tmp_path, "plain", signal.SIGINT)
    assert code != 0  # KeyboardInterrupt, as without torch-upd
    assert closed_cleanly(path)


SIGTERM_INSIDE_A_HOOK = textwrap.dedent("""
    import os, signal, sys, torch, upd
    from upd import lifetime
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = upd.record(sys.argv[1], model, opt, every=1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with lifetime.signals_deferred(rec):  # as inside the recorder's hook
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):
            pass  # the Python-level handler runs at the next bytecode: it has had every chance
        print("still recording" if rec.active else "closed inside the hook", flush=True)
    print("survived the signal", flush=True)
""")


@pytest.mark.slow
def test_sigterm_inside_a_hook_waits_for_the_hook(tmp_path):
    path = str(tmp_path / "run.h5")
    done = subprocess.run([sys.executable, "-c", SIGTERM_INSIDE_A_HOOK, path], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.splitlines() == ["still recording"], done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM  # handled as soon as the hook returned
    assert closed_cleanly(path)


EXIT_WITH_EVERYTHING_OPEN = textwrap.dedent("""
    import atexit, sys, torch, upd
    from upd.runfile.async_writer import AsyncRunWriter
    finished, recording, writing = sys.argv[1:4]
    # Registered before torch-upd's exit handler, so it runs after it.
    atexit.register(lambda: print("run closed" if not run._file.id.valid else "run open", flush=True))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def train(steps):
        for _ in range(steps):
            model(torch.randn(2, 4)).sum().backward()
            opt.step(); opt.zero_grad()
    with upd.record(finished, model, opt, every=1):
        train(2)
    run = upd.open_run(finished)                    # a run open for reading
    rec = upd.record(recording, model, opt, every=1)       # a recorder
    train(3)
    writer = AsyncRunWriter(writing, {}, overwrite=False, storage_dtype="keep", compression=None)
    writer.add_optimizer(0, {})                     # a writer of its own
    sys.exit(0)                                     # none of them closed
""")


@pytest.mark.slow
def test_exit_closes_everything_left_open(tmp_path):
    """Also the plain exit without close: the recorder left open at sys.exit is closed cleanly with every record."""
    finished, recording, writing = (str(tmp_path / f"{name}.h5") for name in ("finished", "recording", "writing"))
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_EVERYTHING_OPEN, finished, recording, writing],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr
    assert done.stdout.split() == ["run", "closed"]
    assert closed_cleanly(recording)
    with upd.open_run(recording) as run:
        assert run.optimizers[0].num_records == 3
    with upd.open_run(writing) as run:
        assert run.optimizers[0].num_records == 0


def test_exit_order_recorders_writers_threads_runs(monkeypatch):
    """Recorders close (and so flush) their own writers before writers are closed and collected writers' threads
    joined; runs open for reading are closed last, still before the interpreter's teardown."""
    from upd import lifetime

    closed = []

    class Closes:
        def __init__(self, label):
            self.label = label

        def close(self):
            closed.append(self.label)

    class Joins:
        def join(self):
            closed.append("thread")

    for kind in ("recorders", "writers", "runs"):
        monkeypatch.setattr(lifetime, kind, lifetime._Open())
    monkeypatch.setattr(lifetime, "writer_threads", lifetime._Open(weak=False))
    held = [Closes("run"), Joins(), Closes("writer"), Closes("recorder")]  # registered in the wrong order
    lifetime.runs.add(held[0])
    lifetime.writer_threads.add(held[1])
    lifetime.writers.add(held[2])
    lifetime.recorders.add(held[3])
    lifetime.close_all()
    assert closed == ["recorder", "writer", "thread", "run"]
