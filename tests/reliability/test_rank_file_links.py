"""A rank's file is named by the recorder (``ranks.rank_path``), not typed by the user: a symlink planted at that
name is never written through, with overwrite=True too. The rank refuses its layout before any file is opened
(``distributed.layout_conflict``, which the recorder turns into one RecorderWarning and an inactive recorder)."""
import os

import pytest

from upd.recorder.distributed import RankSetup, layout_conflict
from upd.runfile import schema
from upd.runfile.ranks import rank_path


@pytest.mark.parametrize("target", ["file", "missing"])
def test_a_symlink_at_a_derived_rank_name_is_refused_and_its_target_untouched(tmp_path, target):
    job = str(tmp_path / "run.h5")
    elsewhere = tmp_path / "elsewhere.h5"
    if target == "file":
        elsewhere.write_bytes(b"precious")
    os.symlink(elsewhere, rank_path(job, 1, 2))
    setup = RankSetup(rank=1, world_size=2, recording_ranks=schema.ALL_RANKS, parallelism=schema.ZERO, job_path=job)
    assert setup.file == rank_path(job, 1, 2)
    conflict = layout_conflict(setup)
    assert conflict is not None and "symbolic link" in conflict and "never followed" in conflict
    assert (elsewhere.read_bytes() == b"precious") if target == "file" else not elsewhere.exists()
    os.remove(rank_path(job, 1, 2))
    assert layout_conflict(setup) is None  # the same layout without the link records
