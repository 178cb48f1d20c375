"""Kill a recording training process with SIGKILL at random moments and count what survives.

    python -m benchmarks.kill_test [--kills 20] [--seed 0] [--aimed N]

For each kill: a child trains a small model with `upd.record` (full tensors every step, Adam, ~40 parameters),
printing after every step how many records the writer had committed (flushed, step marker appended). The parent
kills it with SIGKILL after a random delay, then opens the file with `upd.open_run` and counts readable records.
The promise (docs/reliability.md): the file opens, holds at least every record acknowledged before the kill, and
`upd verify` passes on all of them.

``--aimed N`` adds N rounds of kills aimed at the moments the writer creates objects (tests.harness.kill.AIMED_CHILD:
half-way through the first record, the record after add_param_group, the record where Adam's state appears, the
first statistics rows): each must leave the file as its last commit left it.
"""
from __future__ import annotations

import argparse
import sys

import os
import tempfile

from tests.harness.kill import AIMED_MOMENTS, aimed_kill, aimed_ok, ok, run_kills


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aimed", type=int, default=1, help="rounds of kills aimed at new objects (0: none)")
    args = parser.parse_args()
    aimed_good = 0
    with tempfile.TemporaryDirectory() as tmp:
        aimed = [aimed_kill(os.path.join(tmp, f"{i}-{moment}.h5"), moment)
                 for i in range(args.aimed) for moment in AIMED_MOMENTS]
    for r in aimed:
        aimed_good += aimed_ok(r)
        print(f"aimed at {r['moment']}: records {r['records']}, statistics rows {r['stats_rows']}, "
              f"parameters {r['params']}{', ' + r['error'] if r['error'] else ''}")
    if aimed:
        print(f"{aimed_good}/{len(aimed)} aimed kills left the last commit readable\n")
    results = run_kills(args.kills, args.seed)
    print("| kill | after s | acknowledged | readable | verify | error |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(results):
        print(f"| {i} | {r['delay']:.2f} | {r['acknowledged']} | {r['readable']} | {r['verify']} | {r['error'] or ''} |")
    good = sum(ok(r) for r in results)
    lost = [r["readable"] - r["acknowledged"] for r in results if r["readable"] is not None]
    print(f"\n{good}/{len(results)} kills kept every acknowledged record readable and verifiable; "
          f"records beyond the acknowledged ones: min {min(lost, default=0)}, max {max(lost, default=0)}")
    return 0 if good == len(results) and aimed_good == len(aimed) else 1


if __name__ == "__main__":
    sys.exit(main())
