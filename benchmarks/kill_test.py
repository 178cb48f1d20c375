"""Kill a recording training process with SIGKILL at random moments and count what survives.

    python -m benchmarks.kill_test [--kills 20] [--seed 0]

For each kill: a child trains a small model with `upd.record` (full tensors every step, Adam, ~40 parameters),
printing after every step how many records the writer had committed (flushed, step marker appended). The parent
kills it with SIGKILL after a random delay, then opens the file with `upd.open_run` and counts readable records.
The promise (docs/reliability.md): the file opens, holds at least every record acknowledged before the kill, and
`upd verify` passes on all of them.
"""
from __future__ import annotations

import argparse
import sys

from tests.harness.kill import ok, run_kills


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = run_kills(args.kills, args.seed)
    print("| kill | after s | acknowledged | readable | verify | error |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(results):
        print(f"| {i} | {r['delay']:.2f} | {r['acknowledged']} | {r['readable']} | {r['verify']} | {r['error'] or ''} |")
    good = sum(ok(r) for r in results)
    lost = [r["readable"] - r["acknowledged"] for r in results if r["readable"] is not None]
    print(f"\n{good}/{len(results)} kills kept every acknowledged record readable and verifiable; "
          f"records beyond the acknowledged ones: min {min(lost, default=0)}, max {max(lost, default=0)}")
    return 0 if good == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
