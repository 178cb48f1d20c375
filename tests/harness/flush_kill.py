"""SIGKILL a recording process at an exact write of its writer, with strace (docs/reliability.md, "Crash safety").

A child trains the model of tests/harness/live.py (20 Linear layers, Adam, full tensors every step) and waits for
each record's commit before its next step, so the writer thread's sequence of `pwrite64` calls is the same in every
run. `trace` runs it once under strace and returns every record's writes; `kill_at` runs it again with
`inject=pwrite64:signal=SIGKILL:when=N`, which kills it at exactly its N-th write. Used by
tests/reliability/test_flush_kill.py and `python -m benchmarks.flush_kill`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from tests.harness.kill import read_back

CHILD = textwrap.dedent("""
    import sys, time, torch, upd
    torch.manual_seed(0)
    width, steps = int(sys.argv[2]), int(sys.argv[3])
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = upd.record(sys.argv[1], model, opt, every=1)
    sys.stderr.write("READY\\n"); sys.stderr.flush()
    sys.stdin.readline()  # strace attaches here: it never slows the imports, and counts the training's writes only
    for step in range(steps):
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        while rec._writer.records_written < step + 1:  # one record in flight at a time: the same writes every run
            time.sleep(0.001)
        sys.stderr.write(f"MARK {step}\\n"); sys.stderr.flush()
    rec.close()
""")

_MARK = re.compile(r'write\(2, "MARK (\d+)')
_PWRITE = re.compile(r"pwrite64\(.*, (\d+), (\d+)\) += ")


def _strace(path: str, width: int, steps: int, *options: str) -> str:
    """Run the child, strace attached once its recorder is set up; what the child wrote to stderr."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(width), str(steps)], stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    tracer = None
    try:
        for line in child.stderr:  # warnings may come first
            if line.strip() == "READY":
                break
        tracer = subprocess.Popen(["strace", "-f", "-p", str(child.pid), "-e", "trace=pwrite64,write", *options],
                                  stderr=subprocess.PIPE, text=True)
        assert "attached" in tracer.stderr.readline()  # "Process N attached with K threads": every thread
        child.stdin.write("go\n")
        child.stdin.flush()
        err = child.stderr.read()
        child.wait(timeout=600)
        tracer.wait(timeout=60)
        return err
    finally:
        child.kill()
        if tracer is not None:
            tracer.kill()


def trace(path: str, width: int = 32, steps: int = 6) -> list[list[tuple[int, int]]]:
    """Every record's writes, in order, as (bytes, offset) pairs."""
    log = f"{path}.strace"
    _strace(path, width, steps, "-o", log)
    records, current = [], []
    with open(log) as f:
        for line in f:
            write = _PWRITE.search(line)
            if write:
                current.append((int(write.group(1)), int(write.group(2))))
            elif _MARK.search(line):
                records.append(current)
                current = []
    os.remove(log)
    return records


def growth_record(records: list) -> int:
    """The first record, after the first few (which create the datasets), that writes more than the one before:
    where the chunk indices grow new nodes or blocks."""
    for i in range(3, len(records)):
        if len(records[i]) > len(records[i - 1]) * 1.05:
            return i
    raise ValueError("no record wrote more than the one before it: train more steps")


def superblock_write(writes: list[tuple[int, int]]) -> int:
    """The 1-based position, among a record's writes, of its first write of the superblock (offset 0): the end of
    the flush of its rows."""
    return next(i for i, (_, offset) in enumerate(writes, 1) if offset == 0)


def kill_at(path: str, write: int, width: int = 32, steps: int = 6) -> int:
    """Run the child, killed at its `write`-th write of the training (1-based); the records it acknowledged."""
    err = _strace(path, width, steps, "-o", os.devnull, "-e", f"inject=pwrite64:signal=SIGKILL:when={write}")
    marks = [int(m) for m in re.findall(r"^MARK (\d+)$", err, re.M)]
    return marks[-1] + 1 if marks else 0


def problem(path: str, acknowledged: int) -> str | None:
    """None when the run opens, holds every acknowledged record and verifies (tests.harness.kill.read_back); else
    what is wrong."""
    found = read_back(path)
    if found["error"] is not None:
        return found["error"][:300]
    if found["live"]:
        return "the killed writer's run reads as live"
    if found["readable"] < acknowledged:
        return f"{found['readable']} records, {acknowledged} acknowledged"
    return None if found["verify"] in (0, None) else f"verify exit {found['verify']}"
