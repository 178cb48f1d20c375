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
    rec = upd.record(sys.argv[1], model, opt, stats_every=1)
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
    import upd

    result = {"delay": delay, "acknowledged": acknowledged, "readable": None, "verify": None, "error": None}
    try:
        with upd.open_run(path) as run:
            result["readable"] = run.optimizers[0].num_records
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
