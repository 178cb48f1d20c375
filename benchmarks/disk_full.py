"""Fill the "disk" under a recording process at many points and count runs that stay readable.

    python -m benchmarks.disk_full [--limits 8] [--mode all|estimate+reserve|reserve|estimate|none] [--cost]

Each child trains a small Adam model for 60 steps with `upd.record` (about 100 KB per record) under a file-size
limit (RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past it fails with EFBIG as on a full volume). The limit moves
by 37 KB per trial, so the failure lands at different places inside a record. Modes switch off the writer's
defences to show what each buys:

- estimate+reserve: the shipped writer (free-space estimate, then fallocate of the record's bytes);
- reserve: the estimate disabled; the reservation alone must stop the record before anything is written;
- estimate: the reservation disabled;
- none: both disabled: HDF5 meets the full disk in the middle of a write.

A trial passes when training finished all 60 steps (exit 0), the run opens, and `upd verify` passes on it.
`--cost` also times the writer per record with and without the reservation (fresh processes, alternated).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

from tests.harness.disk_full import MODES, ok, run_trials


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limits", type=int, default=8)
    parser.add_argument("--mode", choices=["all", *MODES], default="all")
    parser.add_argument("--cost", action="store_true", help="also time the writer with and without the reservation")
    args = parser.parse_args()
    if args.cost:
        cost = reservation_cost()
        print(f"writer time per 84 MB record: {cost['with_reservation_s'] * 1e3:.0f} ms with the reservation, "
              f"{cost['without_s'] * 1e3:.0f} ms without: {cost['ratio']:.2f}x")
    failed = False
    for mode in (MODES if args.mode == "all" else [args.mode]):
        results = run_trials(args.limits, mode)
        good = sum(map(ok, results))
        crashed = sum(r["exit"] != 0 for r in results)
        unreadable = sum(r["error"] is not None for r in results)
        print(f"{mode:>17}: {good}/{len(results)} ok; training crashed {crashed}, run unreadable {unreadable}")
        for r in results:
            if not ok(r):
                print("    ", r)
        failed |= mode == "estimate+reserve" and good < len(results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


COST = textwrap.dedent("""
    import os, sys, time, torch, upd
    import upd.runfile.writer as W
    reserve = sys.argv[2] == "1"
    if not reserve:
        os.posix_fallocate = lambda fd, offset, length: None
    spent = []
    write = W.RunWriter.write
    def timed(self, rec):
        t = time.perf_counter(); write(self, rec); spent.append(time.perf_counter() - t)
    W.RunWriter.write = timed
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(sys.argv[1], model, opt, every=1, overwrite=True):
        for _ in range(12):
            model(torch.randn(8, 1024)).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
    spent.sort()
    print(spent[len(spent) // 2])
""")


def reservation_cost(rounds: int = 5, workdir: str | None = None) -> dict:
    """Median writer time per record (4.2M-parameter Adam model, 84 MB per record) with and without the
    reservation, the two alternated in fresh processes; returns seconds per record and their ratio."""
    times = {"1": [], "0": []}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for _ in range(rounds):
            for reserve in ("1", "0"):
                out = subprocess.run([sys.executable, "-c", COST, os.path.join(tmp, "cost.h5"), reserve],
                                     capture_output=True, text=True, timeout=600, check=True).stdout
                times[reserve].append(float(out.split()[-1]))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"with_reservation_s": med["1"], "without_s": med["0"], "ratio": med["1"] / med["0"]}
