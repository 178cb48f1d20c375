"""The parameter index (docs/format.md, "/optimizers/<k>/params/"): the recorder writes, at close, what every
parameter group holds; readers list the parameters from it and give the same answer as from the groups. Files
without it (earlier recorders, crashed runs) read as before."""
from __future__ import annotations

import json
import shutil

import h5py
import pytest
import torch
from torch import nn

import upd
from upd.runfile import param_index, schema
from upd.runfile.writer import index_from_file

from tests.harness.training import MLP

PARAMS = schema.PARAMS_GROUP.path(k=0)
STEPS = 5


def record_varied(path: str, steps: int = STEPS, resume: bool = False) -> str:
    """Adam on an MLP plus a parameter with a gradient at even steps only (fewer rows than records) and one that
    joins in a second param group at step 2 (its rows start late); float16 storage (stored dtypes differ from the
    parameters')."""
    torch.manual_seed(0)
    model = nn.Module()
    model.net = MLP()
    model.sometimes = nn.Parameter(torch.randn(5))
    model.late = nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.Adam([*model.net.parameters(), model.sometimes], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with upd.record(path, model, opt, dtype="float16", overwrite=not resume, resume=resume, every=1):
        for step in range(steps):
            if step == 2:
                opt.add_param_group({"params": [model.late], "lr": 1e-3})
            opt.zero_grad()
            loss = model.net(torch.randn(4, 16, generator=g)).pow(2).mean() + model.late.pow(2).sum()
            if step % 2 == 0:
                loss = loss + model.sometimes.pow(2).sum()
            loss.backward()
            opt.step()
    return path


@pytest.fixture(scope="module")
def varied_run(tmp_path_factory):
    return record_varied(str(tmp_path_factory.mktemp("index") / "varied.h5"))


def read_index(path: str) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f[PARAMS].attrs[schema.PARAM_INDEX])


def write_index(path: str, value) -> None:
    with h5py.File(path, "r+") as f:
        f[PARAMS].attrs[schema.PARAM_INDEX] = value if isinstance(value, str) else json.dumps(value)


def without_index(path: str, folder) -> str:
    """A copy of the run as a recorder before the index wrote it."""
    copy = str(folder / "old-style.h5")
    shutil.copy(path, copy)
    with h5py.File(copy, "r+") as f:
        del f[PARAMS].attrs[schema.PARAM_INDEX]
    return copy


def describe(path: str) -> tuple[dict, str | None]:
    with upd.open_run(path) as run:
        desc = run.describe()
        problem = run.optimizers[0].param_index_problem
    del desc["path"], desc["size_bytes"]
    return desc, problem


def by_key(entries: list) -> list:
    return sorted(entries, key=lambda e: e[param_index.KEY])


def test_the_recorder_writes_an_index_that_matches_the_groups(varied_run, tmp_path):
    index = read_index(varied_run)
    assert index[param_index.RECORDS] == STEPS
    with h5py.File(varied_run, "r") as f:
        from_groups = index_from_file(f[PARAMS], STEPS)
    assert by_key(index[param_index.PARAMS]) == by_key(from_groups)
    entries = {e["key"]: e for e in index[param_index.PARAMS]}
    assert entries["sometimes"]["rows"] == 3 and entries["late"]["rows"] == 3 and entries["net.fc1.weight"]["rows"] == 5
    assert entries["late"]["meta"]["group"] == 1
    assert entries["net.fc1.weight"]["kinds"] == {"param": "float16", "grad": "float16", "param_after": "float16"}
    assert entries["net.fc1.weight"]["state_keys"] == ["step", "exp_avg", "exp_avg_sq"]
    # the comparison above sees a group that differs from what was recorded
    broken = str(tmp_path / "broken.h5")
    shutil.copy(varied_run, broken)
    with h5py.File(broken, "r+") as f:
        del f[f"{PARAMS}/sometimes/{schema.KIND_GRAD}"]
        assert by_key(index_from_file(f[PARAMS], STEPS)) != by_key(index[param_index.PARAMS])


def test_listing_from_the_index_is_what_the_groups_give(varied_run, tmp_path):
    old_style = without_index(varied_run, tmp_path)
    listed, problem = describe(varied_run)
    read, old_problem = describe(old_style)
    assert problem is None and old_problem == "no parameter index"
    assert listed == read
    assert [p["rows"] for p in listed["optimizers"][0]["params"]].count(3) == 2  # sometimes, late
    with upd.open_run(varied_run) as a, upd.open_run(old_style) as b:
        assert a.params().equals(b.params())
    # the listing above came from the index: an index that says otherwise is what is listed
    index = read_index(varied_run)
    next(e for e in index["params"] if e["key"] == "late")["rows"] = 2
    changed = str(tmp_path / "changed.h5")
    shutil.copy(varied_run, changed)
    write_index(changed, index)
    lied, _ = describe(changed)
    assert lied != read
    assert next(p for p in lied["optimizers"][0]["params"] if p["name"] == "late")["rows"] == 2


@pytest.mark.slow
def test_a_run_with_or_without_its_index_analyzes_and_verifies_the_same(varied_run, tmp_path):
    old_style = without_index(varied_run, tmp_path)
    with upd.open_run(varied_run) as a, upd.open_run(old_style) as b:
        assert a.ratios(source="tensors").equals(b.ratios(source="tensors"))
    checks = [upd.verify(path).checks.drop(columns=["explanation"], errors="ignore") for path in (varied_run, old_style)]
    assert len(checks[0]) > 0 and checks[0].equals(checks[1])


def test_a_resumed_run_gets_an_index_of_every_record(tmp_path):
    path = record_varied(str(tmp_path / "resumed.h5"), steps=3)
    assert read_index(path)[param_index.RECORDS] == 3
    record_varied(path, steps=2, resume=True)
    index = read_index(path)
    with h5py.File(path, "r") as f:
        assert index[param_index.RECORDS] == len(f[schema.RECORD_TABLE.path(k=0)][schema.COMMIT_COLUMN]) == 5
        assert by_key(index[param_index.PARAMS]) == by_key(index_from_file(f[PARAMS], 5))
    assert describe(path)[1] is None


def test_an_index_written_for_other_records_is_ignored(varied_run, tmp_path):
    """What a recorder that predates the index leaves when it resumes a run: the index describes fewer records."""
    stale = str(tmp_path / "stale.h5")
    shutil.copy(varied_run, stale)
    index = read_index(varied_run)
    index[param_index.RECORDS] = STEPS - 1
    write_index(stale, index)
    desc, problem = describe(stale)
    assert problem == f"written for {STEPS - 1} records, the file has {STEPS}"
    assert desc == describe(without_index(varied_run, tmp_path))[0]


LISTS_AND_SAYS_IF_TORCH = """
import sys
from upd.cli.main import main
try:
    main(["info", sys.argv[1]], prog_name="upd")
except SystemExit as exc:
    assert not exc.code, exc.code
print("torch imported" if "torch" in sys.modules else "no torch")
"""


@pytest.mark.slow
def test_upd_info_on_an_indexed_run_imports_no_torch(varied_run, tmp_path):
    """torch's import is most of a listing's cost (3 s and 200 MB of CPU time and memory here): `upd info` lists an
    indexed run without it. A run without an index imports it (its 'stored as' dtypes are checked by torch's names),
    which shows the check can see it."""
    import subprocess
    import sys

    def last_line(path):
        done = subprocess.run([sys.executable, "-c", LISTS_AND_SAYS_IF_TORCH, path], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    assert last_line(varied_run) == "no torch"
    assert last_line(without_index(varied_run, tmp_path)) == "torch imported"


def test_no_index_is_written_over_a_record_that_was_never_committed(tmp_path, monkeypatch):
    """A write that fails half-way leaves rows of a record that was never committed: an index written then would list
    them, so the recorder leaves it out and the run reads from its groups (every committed record intact)."""
    from upd.runfile import full_rows
    from upd.runfile.record import ParamSnapshot, Record
    from upd.runfile.writer import RunWriter

    path = str(tmp_path / "failed.h5")
    writer = RunWriter(path, {"options": {}}, overwrite=True, storage_dtype="keep", compression=None)
    writer.add_optimizer(0, {"class": "torch.optim.SGD"})

    def record(step):
        return Record(0, step, step, 0.0, [{"lr": 0.1}],
                      [ParamSnapshot(f"w{i}", 0, i, param=torch.ones(3) * step, grad=torch.ones(3),
                                     param_after=torch.ones(3)) for i in range(2)])

    writer.write(record(0))
    real_write, calls = full_rows.ParamRows.write, []

    def fails_at_the_second_parameter(self, snap, rec, **more):
        calls.append(snap.name)
        if len(calls) == 2:
            raise OSError("disk went away")
        return real_write(self, snap, rec, **more)

    monkeypatch.setattr(full_rows.ParamRows, "write", fails_at_the_second_parameter)
    with pytest.raises(OSError):
        writer.write(record(1))
    monkeypatch.undo()
    writer.close()
    with h5py.File(path, "r") as f:
        assert schema.PARAM_INDEX not in f[PARAMS].attrs
        assert f[f"{PARAMS}/w0/{schema.RECORD_INDEX}"].shape[0] == 2  # the uncommitted row is there
    with upd.open_run(path) as run:
        assert run.optimizers[0].param_index_problem == "no parameter index"
        assert [p.num_rows for p in run.optimizers[0].param_records.values()] == [1, 1]
    # without the failure the same writer writes the index
    clean = RunWriter(str(tmp_path / "clean.h5"), {"options": {}}, overwrite=True, storage_dtype="keep",
                      compression=None)
    clean.add_optimizer(0, {"class": "torch.optim.SGD"})
    clean.write(record(0))
    clean.write(record(1))
    clean.close()
    assert read_index(str(tmp_path / "clean.h5"))[param_index.RECORDS] == 2
