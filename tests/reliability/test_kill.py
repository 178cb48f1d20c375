"""SIGKILL a real recording process at random moments: every acknowledged record stays readable (a few kills in
CI; `python benchmarks/kill_test.py` runs 20 or more)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kill_test  # noqa: E402


def test_sigkill_keeps_every_acknowledged_record(tmp_path):
    results = kill_test.run_kills(kills=3, seed=1, low=0.3, high=1.5, workdir=str(tmp_path))
    for r in results:
        assert kill_test.ok(r), r
    assert any(r["acknowledged"] > 0 for r in results)
