"""SIGKILL a real recording process at random moments: every acknowledged record stays readable (a few kills in
CI; `python -m benchmarks.kill_test` runs 20 or more)."""
import pytest

from tests.harness import kill

pytestmark = pytest.mark.slow  # each kill waits for a subprocess to train and be killed


def test_sigkill_keeps_every_acknowledged_record(tmp_path):
    results = kill.run_kills(kills=3, seed=1, low=0.3, high=1.5, workdir=str(tmp_path))
    for r in results:
        assert kill.ok(r), r
    assert any(r["acknowledged"] > 0 for r in results)
