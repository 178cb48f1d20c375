"""Read a run while another process writes it, at random moments, and check every read.

    python -m benchmarks.live_read [--reads 40] [--seed 0] [--in-place]

A child trains a model with `upd.record` (full tensors every step, Adam, 20 layers of 32x32 by default: 0.4 MB and
about 200 dataset writes per record, so a read often lands in the middle of one; --pause seconds of other work per
step keep the file small enough for every read to check it whole), printing after every step how many records the
writer had committed. The parent opens the run with `upd.open_run` at random moments and checks each read: it is
marked live, it holds at least the records acknowledged before the open, its steps are 0..n-1 in order, and
(every 5th read) its ratios compute and `upd verify` passes on it. After --steps steps the child idles with the run
still open, so the file stays small enough to check whole. At the end the child is killed with SIGKILL: the file must
then read as not live, with every acknowledged record.

`--in-place` reads the live file directly instead of a copy taken between two records (what the lock protocol in
upd/runfile/livelock.py prevents), to show what the protocol buys: those reads may fail, or return wrong data.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from tests.harness.live import ok, run_live_reads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=32, help="layer width of the child's model")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds of other work per training step")
    parser.add_argument("--steps", type=int, default=400, help="steps the child trains before it idles, still open")
    parser.add_argument("--in-place", action="store_true", help="read the live file directly (no copy, no lock)")
    args = parser.parse_args()
    results, final = run_live_reads(args.reads, args.seed, args.width, args.pause, args.steps,
                                    in_place=args.in_place)
    for r in results:
        print(r)
    good = sum(ok(r, live=not args.in_place) for r in results)
    opened = [r for r in results if r["open_ms"] is not None]
    how = "in place, no lock" if args.in_place else "copy between records"
    print(f"\n{good}/{len(results)} live reads correct ({how})")
    if opened:
        mb = statistics.median(r["bytes"] for r in opened) / 1e6
        ms = statistics.median(r["open_ms"] for r in opened)
        print(f"median open (copy included): {ms:.0f} ms for a {mb:.0f} MB run; records per read "
              f"{min(r['records'] for r in opened)}..{max(r['records'] for r in opened)}")
    print(f"after SIGKILL: {'ok' if ok(final, live=False) else 'FAILED'} {final}")
    return 0 if good == len(results) and ok(final, live=False) else 1


if __name__ == "__main__":
    sys.exit(main())
