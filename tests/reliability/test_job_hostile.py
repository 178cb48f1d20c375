"""A distributed job's rank files from a stranger (issue 21, item 8 and the rank-file findings): every bad value is
refused in one line (exit 2, never the generic "set UPD_DEBUG=1" fallback) or, when it is only informational,
read as unknown.

- global_shape is checked with Python integers: [2**64 + 12] wrapped int64 to 12 elements and passed the tiling
  check; [10**30] raised OverflowError;
- recording_ranks an int, null or an object raised TypeError;
- metadata nested ~900 deep raised RecursionError in `info`'s text cleaning (nesting is bounded when parsing);
- a resume entry's created_unix of 1e300 or NaN made `info` refuse a valid file;
- rank files: one canonical name per rank in ASCII digits (rank00-of-03 or Arabic-Indic digits were read,
  depending on directory order), no symlink followed, and shards whose dtypes disagree are refused, not cast.
"""
import json
import os
import shutil

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import upd
from upd.cli.main import main
from upd.runfile import schema
from upd.runfile.ranks import rank_path

from tests.harness.training import record_run
from tests.runfile.test_job import WORLD, copy_job, write_sharded_job

pytestmark = pytest.mark.slow  # the module's job is cut from a real run once (a few seconds)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-job")
    single = record_run(str(folder / "single.h5"), lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), steps=3)
    path = str(folder / "job.h5")
    write_sharded_job(single, path)
    return path


def _edit_ranks(path, edit, ranks=range(WORLD)):
    for rank in ranks:
        with h5py.File(rank_path(path, rank, WORLD), "r+") as f:
            for k in f[schema.OPTIMIZERS]:
                f[schema.PARAMS_GROUP.path(k=k)].attrs.pop(schema.PARAM_INDEX, None)
            edit(f, rank)


def _set_param_meta(name, **changes):
    def edit(f, rank):
        group = f[schema.PARAMETER.path(k=0, name=name)]
        group.attrs[schema.ATTR_META] = json.dumps({**json.loads(group.attrs[schema.ATTR_META]), **changes})
    return edit


def _set_root_meta(change):
    def edit(f, rank):
        meta = json.loads(f.attrs[schema.ATTR_META])
        change(meta)
        f.attrs[schema.ATTR_META] = json.dumps(meta)
    return edit


def _commands(path, expected, *words):
    for args in (["info"], ["analyze", "--no-plots"], ["verify"]):
        result = CliRunner().invoke(main, [*args, path])
        assert result.exit_code in expected, (args, result.exit_code, result.output)
        if result.exit_code == 2:
            lines = result.stderr.splitlines()
            assert len(lines) == 1 and "UPD_DEBUG" not in lines[0] and "Traceback" not in result.output, lines
            for word in words:
                assert word in lines[0], (word, lines[0])


def _recording_ranks(value):
    return _set_root_meta(lambda meta: meta[schema.META_DISTRIBUTED].update(recording_ranks=value))


def _deep(meta):
    deep = 0
    for _ in range(900):
        deep = [deep]
    meta["argv"] = deep


REFUSED = [
    ("global_shape wrapping int64", _set_param_meta("fc1.bias", global_shape=[2 ** 64 + 12]), "global shape"),
    ("global_shape past int64", _set_param_meta("fc1.bias", global_shape=[10 ** 30]), "global shape"),
    ("global_shape of 2**61+6 rows", _set_param_meta("fc1.weight", global_shape=[2 ** 61 + 6, 16]), "global shape"),
    ("recording_ranks an int", _recording_ranks(3), "recording_ranks"),
    ("recording_ranks null", _recording_ranks(None), "recording_ranks"),
    ("recording_ranks an object", _recording_ranks({"a": 1}), "recording_ranks"),
    ("recording_ranks past the world", _recording_ranks([0, 1, 7]), "recording_ranks"),
    ("metadata nested 900 deep", _set_root_meta(_deep), "nested deeper"),
]


@pytest.mark.parametrize("what, edit, word", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_job_metadata_is_refused_in_one_line(job, tmp_path, what, edit, word):
    path = copy_job(job, tmp_path)
    _edit_ranks(path, edit)
    _commands(path, {2}, path if what.startswith("global") else "", word)


@pytest.mark.parametrize("created", [1e300, float("nan"), "yesterday"])
def test_a_bad_resume_time_is_unknown_not_a_broken_file(job, tmp_path, created):
    path = copy_job(job, tmp_path)

    def edit(f, rank):
        f.attrs[schema.ATTR_RESUMES] = json.dumps([{"created_unix": created, "argv": ["train.py"]}])
    _edit_ranks(path, edit)
    _commands(path, {0})
    with upd.open_run(path) as run:
        assert run.ranks[0].resumes[0]["created_unix"] is None


def test_only_the_canonical_ascii_name_is_a_rank_file(job, tmp_path):
    path = copy_job(job, tmp_path)
    stem = path[:-len(".h5")]
    with upd.open_run(path) as run:
        expected = run.param("fc1.weight").read("param")
    # another spelling of rank 0 next to the real one: never read, whatever the folder's order
    other = str(tmp_path / "other.h5")
    shutil.copy(rank_path(job, 1, WORLD), other)  # a different rank's content under rank 0's other names
    for name in (f"{stem}.rank00-of-03.h5", f"{stem}.rank0-of-003.h5"):
        shutil.copy(other, name)
    with upd.open_run(path) as run:
        assert torch.equal(run.param("fc1.weight").read("param"), expected)
    # digits of another script are not rank numbers
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(rank_path(job, 0, WORLD), lone / "job.rank\u0660-of-\u0663.h5")
    with pytest.raises(upd.RunFileError, match="no such"):
        upd.open_run(str(lone / "job.h5"))


def test_a_rank_file_that_is_a_symlink_is_not_followed(job, tmp_path):
    path = copy_job(job, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.replace(rank_path(path, 2, WORLD), elsewhere / "secret.h5")
    os.symlink(elsewhere / "secret.h5", rank_path(path, 2, WORLD))
    _commands(path, {2}, "symbolic link")
    with upd.open_run(rank_path(path, 2, WORLD)) as run:  # named by the user: read
        assert run.optimizers


def test_shards_of_different_dtypes_are_refused_not_cast(job, tmp_path):
    path = copy_job(job, tmp_path)

    def as_float64(f, rank):
        name = schema.PARAMETER.at(schema.KIND_PARAM, k=0, name="fc1.weight")
        data, attrs = f[name][()].astype(np.float64), dict(f[name].attrs)
        del f[name]
        f.create_dataset(name, data=data, maxshape=(None, *data.shape[1:]))
        f[name].attrs.update({**attrs, "torch_dtype": "float64"})
    _edit_ranks(path, as_float64, ranks=[1])
    with pytest.raises(upd.RunFileError, match="shards of one tensor must agree"):
        upd.open_run(path)
    _commands(path, {2}, "must agree")
