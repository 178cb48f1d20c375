"""SIGKILL a real recording process at random moments: every acknowledged record stays readable (a few kills in
CI; `python -m benchmarks.kill_test` runs 20 or more)."""
import pytest

from tests.harness import kill

pytestmark = pytest.mark.slow  # each kill waits for a subprocess to train and be killed


def test_sigkill_keeps_every_acknowledged_record(tmp_path):
    # A kill at a random moment after a record was acknowledged, so that a kill with something to keep happens
    # however slow the machine is. (A kill before anything was acknowledged is test_kills_aimed_at_new_objects_
    # leave_the_last_commit's first record and first statistics rows, aimed rather than left to chance. Each
    # kill is a process importing torch; `python -m benchmarks.kill_test` runs twenty or more.)
    results = kill.run_kills(kills=1, seed=2, low=0.0, high=0.5, workdir=str(tmp_path), after_records=1)
    for r in results:
        assert kill.ok(r), str(r)  # a string: shown whole (a dict is cut, and the error with it)
    assert results[-1]["acknowledged"] > 0


def test_kills_aimed_at_new_objects_leave_the_last_commit(tmp_path):
    """A kill while the first record, the record after add_param_group, the record where Adam's state appears, or
    the first statistics rows are being written: the file reads as the last commit left it (no committed records
    for the first record). Before the writer linked new objects at their commit, the first three files were
    unreadable ("bad heap free list", "record indices ... not in increasing order", "len not positive after
    adjustment for EOA")."""
    results = kill.aimed_kills(str(tmp_path))  # one child per moment, forked from one process that imported torch
    for r in results:
        assert kill.aimed_ok(r), str(r)
    first = results[0]
    assert first["records"] == first["params"] == first["steps"] == 0
