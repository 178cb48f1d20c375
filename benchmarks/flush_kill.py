"""Kill a recording process at chosen writes of the record in which HDF5's chunk indices grow.

    python -m benchmarks.flush_kill [--points 12] [--steps 70] [--record N]

benchmarks/kill_test.py kills at random moments; this aims (tests/harness/flush_kill.py: the child, strace). A
first run counts the writes of every record and picks the first record that writes more than the one before: the
one where the chunk indices grow (with HDF5's default B-trees, every dataset's root splits at its 65th chunk, record
64; with the extensible arrays the writer uses, a new data block at record 4). Then one run per kill point, spread
over that record's writes: each must leave a run that opens, holds every acknowledged record and verifies.

Needs Linux and strace (Debian: `apt-get install strace`). Findings in docs/reliability.md ("Crash safety").
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from tests.harness import flush_kill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=12, help="kill points spread over the record's writes")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=70, help="steps the child trains")
    parser.add_argument("--record", type=int, default=None,
                        help="kill during this record's writes (default: the first that writes more)")
    args = parser.parse_args()
    if shutil.which("strace") is None:
        print("strace is not installed (Debian: apt-get install strace)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        records = flush_kill.trace(os.path.join(tmp, "count.h5"), args.width, args.steps)
        record = flush_kill.growth_record(records) if args.record is None else args.record
        before, writes = sum(len(r) for r in records[:record]), len(records[record])
        print(f"record {record} writes {writes} times (the one before: {len(records[record - 1])}; its superblock "
              f"at write {flush_kill.superblock_write(records[record])}); killing at {args.points} of its writes")
        failed = 0
        for i in range(args.points):
            k = 1 + i * (writes - 1) // max(1, args.points - 1)
            path = os.path.join(tmp, f"kill-{k}.h5")
            acknowledged = flush_kill.kill_at(path, before + k, args.width, args.steps)
            problem = flush_kill.problem(path, acknowledged)
            failed += problem is not None
            print(f"  write {k:4d}/{writes}: {acknowledged} acknowledged, "
                  f"{'read and verified' if problem is None else problem}", flush=True)
        print(f"{args.points - failed}/{args.points} kills left a readable file with every acknowledged record")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
