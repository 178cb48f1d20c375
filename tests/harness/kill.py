"""SIGKILL a recording training process at a chosen moment and check what survives (docs/reliability.md).

A child trains a small model with `upd.record` (full tensors every step, Adam, ~40 parameters), printing after
every step how many records the writer had committed. The parent kills it with SIGKILL after a delay, then opens
the file with `upd.open_run` and counts readable records. The promise: the file opens, holds at least every record
acknowledged before the kill, and `upd verify` passes on all of them. tests/reliability/test_kill.py runs a few
kills, `python -m benchmarks.kill_test` twenty or more.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

CHILD = textwrap.dedent("""
    import sys, torch, upd
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = upd.record(sys.argv[1], model, opt, every=1, stats_every=1)
    print("started", flush=True)
    for step in range(100000):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        print("committed", rec._writer.records_written, flush=True)
""")


def one_kill(path: str, delay: float, after_records: int = 0) -> dict:
    """Kill the child `delay` seconds after it has acknowledged `after_records` records (0: after it started)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path], stdout=subprocess.PIPE, text=True)
    acknowledged = 0
    assert proc.stdout.readline().strip() == "started"
    while acknowledged < after_records:  # on a loaded machine the first step alone can outlast any fixed delay
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("committed"):
            acknowledged = int(line.split()[1])
    deadline = time.monotonic() + delay
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    os.set_blocking(proc.stdout.fileno(), True)
    for line in proc.stdout.read().splitlines():
        if line.startswith("committed"):
            acknowledged = int(line.split()[1])
    return {"delay": delay, "acknowledged": acknowledged, **read_back(path)}


def read_back(path: str) -> dict:
    """What a killed writer's run reads as: {"readable": committed records, "live": whether it reads as still being
    written, "verify": upd.verify's exit code (None for no record), "error": what the reader raised, or None}."""
    import upd

    result = {"readable": None, "live": None, "verify": None, "error": None}
    try:
        with upd.open_run(path) as run:
            result["readable"], result["live"] = run.optimizers[0].num_records, run.live
        result["verify"] = upd.verify(path).exit_code if result["readable"] else None
    except Exception as exc:  # a file the reader refuses counts as a failure of the promise
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def run_kills(kills: int, seed: int, low: float = 0.2, high: float = 2.0, workdir: str | None = None,
              after_records: int = 0) -> list:
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for i in range(kills):
            results.append(one_kill(os.path.join(tmp, f"run{i}.h5"), rng.uniform(low, high), after_records))
    return results


def ok(result: dict) -> bool:
    return (result["error"] is None and result["readable"] is not None and
            result["readable"] >= result["acknowledged"] and result["verify"] in (0, None))


# -- kills aimed at the moments the writer creates objects -------------------------------------------------------
# The child kills itself (SIGKILL, from the writer thread) in the middle of writing what a moment creates: the rows
# of its first record (every parameter's group is new), of the record after add_param_group (the new group's
# parameters), of the second record (Adam's state datasets appear in groups readers already see), or of the first
# statistics rows (the statistics table is new). 400 small parameters: enough new objects that HDF5 writes part of
# its metadata to disk before the flush, which is what made such files unreadable.
AIMED_CHILD = textwrap.dedent("""
    import os, signal, sys, time, torch, upd
    from upd.runfile import full_rows, stats_table
    moment = sys.argv[2]
    torch.manual_seed(0)
    first = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2)])
    later = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(200)])  # 400 parameters
    model = torch.nn.Sequential(first, later)
    params = list(model.parameters()) if moment in ("first_record", "new_state", "first_stats") else \\
        list(first.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    # Which call of the patched write kills: three quarters through the parameters that moment brings.
    kill_at = {"first_record": 300, "new_state": 404 + 300, "new_group": 2 * 4 + 4 + 300, "first_stats": 1}[moment]
    calls = [0]
    target = (stats_table.StatsTableWriter, "write") if moment == "first_stats" else (full_rows.ParamRows, "write")
    original = getattr(*target)

    def write(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == kill_at:  # after this part's rows, before the flush that would commit them
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(*target, write)
    rec = upd.record(sys.argv[1], model, opt, every=None if moment == "first_stats" else 1, stats_every=1)
    for step in range(3):  # the last moment (new_group) is in the third record
        if moment == "new_group" and step == 2:
            opt.add_param_group({"params": list(later.parameters()), "lr": 1e-4})
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        while moment != "first_stats" and rec._writer.records_written <= step:  # one record per commit: the
            time.sleep(0.01)  # count of writes above is that of these records alone
""")

AIMED_MOMENTS = ("first_record", "new_group", "new_state", "first_stats")
# Records committed before each moment's kill (its own record is never committed).
AIMED_COMMITTED = {"first_record": 0, "new_group": 2, "new_state": 1, "first_stats": 0}


def aimed_kill(path: str, moment: str) -> dict:
    """Run AIMED_CHILD for `moment` (it kills itself there) and read what it left: records, statistics rows,
    parameters listed, or the error."""
    proc = subprocess.run([sys.executable, "-c", AIMED_CHILD, path, moment], capture_output=True, text=True,
                          timeout=300)
    return read_aimed(path, moment, proc.returncode)


# One process imports torch and upd once and forks a child per moment, which runs AIMED_CHILD itself (the same
# code, the same SIGKILL from its writer thread) in a fresh copy of that process: each kill then costs its training,
# not a Python that imports torch again (three quarters of a child's time). No recorder exists before the fork.
AIMED_FORKS = textwrap.dedent("""
    import os, sys, torch, upd
    from upd.runfile import full_rows, stats_table
    child = compile(sys.argv[1], "<aimed child>", "exec")
    for path, moment in zip(sys.argv[2::2], sys.argv[3::2]):
        pid = os.fork()
        if pid == 0:
            sys.argv = ["-c", path, moment]
            exec(child, {"__name__": "__main__"})
            sys.exit(0)  # the interpreter's own exit, as AIMED_CHILD's process (first_stats is killed in it)
        status = os.waitpid(pid, 0)[1]
        print(moment, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True)
""")


def aimed_kills(folder: str, moments=AIMED_MOMENTS) -> list:
    """aimed_kill for each of `moments`, forked from one process (AIMED_FORKS), each into FOLDER/MOMENT.h5."""
    paths = [os.path.join(folder, f"{moment}.h5") for moment in moments]
    proc = subprocess.run([sys.executable, "-c", AIMED_FORKS, AIMED_CHILD,
                           *[a for pair in zip(paths, moments) for a in pair]], capture_output=True, text=True,
                          timeout=300)
    codes = dict(line.split() for line in proc.stdout.splitlines())
    assert list(codes) == list(moments), proc.stdout + proc.stderr
    return [read_aimed(path, moment, int(codes[moment])) for path, moment in zip(paths, moments)]


def read_aimed(path: str, moment: str, returncode: int) -> dict:
    """What a child killed at `moment` left at `path`."""
    import upd

    result = {"moment": moment, "returncode": returncode, "records": None, "stats_rows": None, "params": None,
              "steps": None, "error": None}
    try:
        with upd.open_run(path) as run:
            opt = run.optimizers[0]
            result.update(records=opt.num_records, stats_rows=len(opt.committed_stats_steps()),
                          params=len(run.params()), steps=len(run.steps()))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def aimed_ok(result: dict) -> bool:
    """Killed where aimed, readable, holding exactly the records committed before that moment."""
    return (result["returncode"] == -signal.SIGKILL and result["error"] is None
            and result["records"] == AIMED_COMMITTED[result["moment"]]
            and (result["moment"] != "first_stats" or result["stats_rows"] == 0))
