"""Read a run at random moments while another process writes it, and check every read (docs/reliability.md).

A child trains a model with `upd.record` (full tensors every step, Adam, 20 layers), printing after every step how
many records the writer had committed, then idles with the run still open. The parent opens the run with
`upd.open_run` at random moments and checks each read: marked live, at least the records acknowledged before the
open, steps 0..n-1 in order, and (every 5th read) ratios and `upd verify`. At the end the child is killed with
SIGKILL: the file must then read as not live, with every acknowledged record. tests/runfile/test_live.py runs a few
reads, `python -m benchmarks.live_read` forty or more.
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
    import sys, time, torch, upd
    torch.manual_seed(0)
    width, pause, steps = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = upd.record(sys.argv[1], model, opt, every=1)
    print("started", flush=True)
    for step in range(steps):
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        print("committed", rec._writer.records_written, flush=True)
        time.sleep(pause)  # the rest of a training step: keeps the file small enough to copy at every read
    time.sleep(3600)  # the run stays open (live) until the parent kills it
""")


class _Child:
    def __init__(self, path: str, width: int, pause: float, steps: int):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, path, str(width), str(pause), str(steps)],
                                     stdout=subprocess.PIPE)
        self._fd = self.proc.stdout.fileno()
        assert self.proc.stdout.readline().strip() == b"started"  # nothing after it is buffered: the child waits
        os.set_blocking(self._fd, False)
        self.acknowledged = 0
        self._tail = ""

    def poll_acknowledged(self) -> int:
        chunk = ""
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            chunk += data.decode()
        lines = (self._tail + chunk).split("\n")
        self._tail = lines.pop()
        for line in lines:
            if line.startswith("committed"):
                self.acknowledged = int(line.split()[1])
        return self.acknowledged

    def wait_acknowledged(self, records: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.poll_acknowledged() < records and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.poll_acknowledged()
        if self._tail.startswith("committed"):
            self.acknowledged = int(self._tail.split()[1])
        return self.acknowledged


def _check_read(path: str, acknowledged: int, verify: bool, in_place: bool) -> dict:
    import upd
    from upd.runfile import livelock

    result = {"acknowledged": acknowledged, "records": None, "live": None, "verify": None, "error": None,
              "open_ms": None, "bytes": None}
    saved = livelock.writer_present
    if in_place:
        livelock.writer_present = lambda fd: False  # read the file under the writer: what the protocol prevents
    try:
        started = time.perf_counter()
        with upd.open_run(path) as run:
            result["open_ms"] = (time.perf_counter() - started) * 1e3
            result["live"], result["bytes"] = run.live, run.size_bytes
            opt = run.optimizers[0]
            result["records"] = opt.num_records
            if [int(s) for s in opt.steps] != list(range(opt.num_records)):
                result["error"] = f"steps are not 0..{opt.num_records - 1}: {list(opt.steps)[:5]}..."
            ratios = run.ratios() if verify else None
            if ratios is not None and opt.num_records and ratios["update_to_data"].isna().all():
                result["error"] = "no update:data ratio could be computed"
            if verify and opt.num_records:
                result["verify"] = upd.verify(run).exit_code
    except Exception as exc:  # a read the reader refuses counts against the promise
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        livelock.writer_present = saved
    return result


def run_live_reads(reads: int, seed: int, width: int = 32, pause: float = 0.05, steps: int = 400, low: float = 0.05,
                   high: float = 0.4, workdir: str | None = None, in_place: bool = False,
                   after_records: int = 0) -> tuple[list, dict]:
    """`reads` reads of a run a child process is writing, the first once it has acknowledged `after_records`
    records; then SIGKILL and one more read. Returns (reads, final)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = os.path.join(tmp, "live.h5")
        child = _Child(path, width, pause, steps)
        results = []
        try:
            child.wait_acknowledged(after_records)
            for i in range(reads):
                time.sleep(rng.uniform(low, high))
                acknowledged = child.poll_acknowledged()
                results.append(_check_read(path, acknowledged, verify=(i % 5 == 4), in_place=in_place))
        finally:
            acknowledged = child.kill()
        final = _check_read(path, acknowledged, verify=True, in_place=False)
    return results, final


def ok(result: dict, live: bool = True) -> bool:
    return (result["error"] is None and result["live"] is live and result["records"] is not None
            and result["records"] >= result["acknowledged"] and result["verify"] in (0, None))
