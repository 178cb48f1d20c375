"""Kill a recording process at chosen writes of the record in which HDF5's chunk indices first split.

    python -m benchmarks.flush_kill [--points 12] [--width 32] [--steps 70]

benchmarks/kill_test.py kills at random moments; this aims. A child trains the model of tests/harness/live.py
(20 Linear layers, Adam, full tensors every step) and waits for each record's commit before the next step, so the
writer's sequence of `pwrite64` calls is the same in every run. A first run under `strace` counts the writes of
every record and picks the first record that writes more than the records before it: the one where the chunk
indices' B-tree roots split (with HDF5's default file format, every chunked dataset's root is full at 64 chunks).
Then one run per kill point: `strace -e inject=pwrite64:signal=SIGKILL:when=N` kills the writer at exactly its N-th
write, spread over that record's writes; the file is opened with `upd.open_run`, must hold every record
acknowledged before the kill, and `upd verify` must pass.

Needs Linux and strace (Debian: `apt-get install strace`). Findings in docs/reliability.md ("Crash safety").
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import sys, time, torch, upd
    torch.manual_seed(0)
    width, steps = int(sys.argv[2]), int(sys.argv[3])
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = upd.record(sys.argv[1], model, opt, every=1)
    for step in range(steps):
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        while rec._writer.records_written < step + 1:  # one record in flight at a time: the same writes every run
            time.sleep(0.001)
        sys.stderr.write(f"MARK {step}\\n"); sys.stderr.flush()
    rec.close()
""")

MARK = re.compile(r'write\(2, "MARK (\d+)')


def _strace(path: str, width: int, steps: int, *extra: str, trace: str | None = None) -> subprocess.CompletedProcess:
    out = ["-o", trace] if trace else ["-o", os.devnull]
    return subprocess.run(["strace", "-f", *out, "-e", "trace=pwrite64,write", *extra,
                           sys.executable, "-c", CHILD, path, str(width), str(steps)],
                          capture_output=True, text=True, timeout=900)


def writes_per_record(trace: str) -> tuple[list[int], list[int]]:
    """(pwrite64 calls before each record's first write, pwrite64 calls of each record) from a strace log."""
    starts, counts, n = [0], [], 0
    with open(trace) as f:
        for line in f:
            if "pwrite64(" in line:
                n += 1
            elif MARK.search(line):
                counts.append(n - starts[-1])
                starts.append(n)
    return starts[:-1], counts


def split_record(counts: list[int]) -> int:
    """The first record (after the first few, which create the datasets) that writes more than the one before."""
    for i in range(3, len(counts)):
        if counts[i] > counts[i - 1] * 1.05:
            return i
    raise SystemExit("no record wrote more than the one before it: try more --steps")


def check(path: str, acknowledged: int) -> str | None:
    import upd

    try:
        with upd.open_run(path) as run:
            records = run.optimizers[0].num_records
            if records < acknowledged:
                return f"{records} records, {acknowledged} acknowledged"
        code = upd.verify(path).exit_code
        return None if code == 0 else f"verify exit {code}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=12, help="kill points spread over the record's writes")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=70, help="steps the child trains (past the first split)")
    args = parser.parse_args()
    if shutil.which("strace") is None:
        print("strace is not installed (Debian: apt-get install strace)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.txt")
        _strace(os.path.join(tmp, "count.h5"), args.width, args.steps, trace=trace)
        starts, counts = writes_per_record(trace)
        record = split_record(counts)
        print(f"record {record} writes {counts[record]} times (the one before: {counts[record - 1]}); "
              f"killing at {args.points} of its writes")
        failed = 0
        for i in range(args.points):
            k = 1 + i * (counts[record] - 1) // max(1, args.points - 1)
            path = os.path.join(tmp, f"kill-{k}.h5")
            done = _strace(path, args.width, args.steps, "-e",
                           f"inject=pwrite64:signal=SIGKILL:when={starts[record] + k}")
            marks = [int(m) for m in re.findall(r"^MARK (\d+)$", done.stderr, re.M)]
            acknowledged = marks[-1] + 1 if marks else 0
            problem = check(path, acknowledged)
            failed += problem is not None
            print(f"  write {k:4d}/{counts[record]}: {acknowledged} acknowledged, "
                  f"{'read and verified' if problem is None else problem}", flush=True)
        print(f"{args.points - failed}/{args.points} kills left a readable file with every acknowledged record")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
