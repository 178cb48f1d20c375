"""The committed sample runs are what the current recorder writes: closed cleanly, with the loss logged."""
import h5py
import pytest

import upd
from upd.runfile import schema

from tests.harness.paths import SAMPLE_RUNS


@pytest.mark.parametrize("path", SAMPLE_RUNS)
def test_sample_runs_are_written_by_the_current_recorder(path):
    with h5py.File(path, "r") as f:
        assert f.attrs[schema.ATTR_CLOSED_CLEANLY] == "true"
        for k in f[schema.OPTIMIZERS_GROUP.path()]:  # the parameter index the recorder writes when it closes
            assert schema.PARAM_INDEX in f[schema.PARAMS_GROUP.path(k=k)].attrs
    with upd.open_run(path) as run:
        assert run.closed_cleanly and run.resumes == []
        steps = run.steps()
        assert steps["loss"].notna().all() and len(steps) == run.optimizers[0].num_records
        assert steps[schema.SCALAR_GRAD_NORM_BACKWARD].notna().all()


def test_the_format_doc_tables_have_no_blank_line_inside():
    """A blank line ends a markdown table: a row after one renders as plain text."""
    from tests.runfile.test_format_doc import read_doc

    lines = read_doc().splitlines()
    for i in range(1, len(lines) - 1):
        assert not (lines[i] == "" and lines[i - 1].startswith("|") and lines[i + 1].startswith("|")), i + 1
