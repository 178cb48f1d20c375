"""A SIGKILL inside the flush of the record where the chunk indices grow keeps every committed record.

strace kills the writer at an exact write (tests/harness/flush_kill.py): the one before the superblock's, the last
of the flush of that record's rows, when every new index node is on disk but the end of file the superblock records
is still the last commit's. With HDF5's default format (B-tree roots full at 64 chunks: OBJECT_FORMATS set to
("earliest", "v110") and STEPS to 66) this test fails, the run unreadable ("addr overflow"); so it does with the
extensible arrays if the reading budget asks HDF5 for the storage size of a torn index without the fallback
(validate.Validator.stored). docs/reliability.md, "Crash safety".
"""
import shutil

import pytest

from tests.harness import flush_kill

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to kill at an exact write")]

STEPS = 5  # the extensible arrays' first new data block comes with record 4


def test_kills_inside_the_flush_where_the_chunk_indices_grow_keep_every_committed_record(tmp_path):
    records = flush_kill.trace(str(tmp_path / "count.h5"), steps=STEPS)
    record = flush_kill.growth_record(records)
    before = sum(len(r) for r in records[:record])
    superblock = flush_kill.superblock_write(records[record])
    k = superblock - 1  # the flush (which ends with the superblock) has written every node but not the end of file
    path = str(tmp_path / "killed.h5")
    acknowledged = flush_kill.kill_at(path, before + k, steps=STEPS)
    assert acknowledged == record, (k, acknowledged)  # killed inside that record, not before or after it
    assert flush_kill.problem(path, acknowledged) is None
