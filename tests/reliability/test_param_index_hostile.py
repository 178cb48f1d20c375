"""A hostile parameter index (docs/reliability.md, "The parameter index"): the index is the file's word like the rest
of it. One that cannot be used as a whole is ignored, and the run reads from its groups exactly as without one; one
that is well-formed but wrong is what `upd info` lists, and is refused in one line as soon as a command reads the
data it describes, before anything is allocated from what it claims."""
from __future__ import annotations

import json
import shutil

import h5py
import pytest

import upd
from upd.runfile import schema

from tests.harness.training import record_run
from tests.reliability.test_hostile_files import check_all_commands, check_api

PARAMS = schema.PARAMS_GROUP.path(k=0)
P = "fc1.weight"
STILL_VALID = {"info": {0}, "analyze": {0}, "verify": {0}}
READ_REFUSES = {"info": {0}, "analyze": {2}, "verify": {2}}


@pytest.fixture(scope="module")
def indexed_run(tmp_path_factory):
    """A real run (Adam, an MLP of four parameters, 4 steps) with the index its recorder wrote."""
    import torch

    return record_run(str(tmp_path_factory.mktemp("hostile-index") / "run.h5"),
                      lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))


def _index(path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f[PARAMS].attrs[schema.PARAM_INDEX])


def _with_index(run, tmp_path, value, name="mutated.h5") -> str:
    path = str(tmp_path / name)
    shutil.copy(run, path)
    with h5py.File(path, "r+") as f:
        if value is None:
            del f[PARAMS].attrs[schema.PARAM_INDEX]
        else:
            f[PARAMS].attrs[schema.PARAM_INDEX] = value if isinstance(value, str) else json.dumps(value)
    return path


def _entry(index: dict, key: str = P) -> dict:
    return next(e for e in index["params"] if e["key"] == key)


def _listing(path) -> tuple[list, str | None]:
    with upd.open_run(path) as run:
        return run.describe()["optimizers"], run.optimizers[0].param_index_problem


def _edit(change):
    def mutate(index):
        change(index)
        return index
    return mutate


# (id, the index text or a change of the recorded one, a word of the reason it is ignored)
IGNORED = [
    ("not JSON", lambda index: "{not json", "not valid JSON"),
    ("a JSON list", lambda index: json.dumps(index["params"]), "not a JSON object"),
    ("records not a number", _edit(lambda i: i.update(records="4")), "written for"),
    ("an entry missing", _edit(lambda i: i["params"].pop()), "the group holds"),
    ("an entry for no group", _edit(lambda i: i["params"].append(dict(_entry(i), key="ghost"))), "the group holds"),
    ("an entry twice", _edit(lambda i: i["params"].append(dict(_entry(i)))), "twice"),
    ("rows past the records", _edit(lambda i: _entry(i).update(rows=10 ** 12)), "rows"),
    ("rows negative", _edit(lambda i: _entry(i).update(rows=-1)), "rows"),
    ("rows true", _edit(lambda i: _entry(i).update(rows=True)), "rows"),
    ("kinds of an unknown kind", _edit(lambda i: _entry(i)["kinds"].update(weights="float32")), "kinds"),
    ("a 100,000-character dtype", _edit(lambda i: _entry(i)["kinds"].update(grad="f" * 100_000)), "kinds"),
    ("state keys repeated", _edit(lambda i: _entry(i).update(state_keys=["step", "step"])), "state_keys"),
    ("a shape of 2**80 elements", _edit(lambda i: _entry(i)["meta"].update(shape=[2 ** 40, 2 ** 40])), "elements"),
    ("a negative shape", _edit(lambda i: _entry(i)["meta"].update(shape=[-1, 16])), "negative"),
    ("a key not a string", _edit(lambda i: _entry(i).update(key=7)), "key"),
    ("a 10,000-deep nesting", lambda index: "[" * 10_000 + "]" * 10_000, "JSON"),
]


@pytest.mark.parametrize("what, mutate, word", IGNORED, ids=[c[0] for c in IGNORED])
def test_an_index_that_cannot_be_used_is_ignored(indexed_run, tmp_path, what, mutate, word):
    """The run is listed from its groups, the same listing as with no index at all."""
    expected, problem = _listing(indexed_run)
    assert problem is None  # the recorded index is used: 'ignored' below is the mutation's doing
    without = _with_index(indexed_run, tmp_path, None, "without.h5")
    assert _listing(without) == (expected, "no parameter index")
    path = _with_index(indexed_run, tmp_path, mutate(_index(indexed_run)))
    listed, problem = _listing(path)
    assert problem is not None and word in problem, problem
    assert listed == expected


def test_an_index_longer_than_any_run_holds_is_ignored_unread(indexed_run, tmp_path):
    """17 MiB of index text: over the limit on JSON attributes, refused by its stored length before HDF5 allocates
    it, so ignored."""
    expected, _ = _listing(indexed_run)
    index = _index(indexed_run)
    _entry(index)["meta"]["padding"] = "x" * (schema.MAX_META_BYTES + (1 << 20))
    path = _with_index(indexed_run, tmp_path, index)
    listed, problem = _listing(path)
    assert "claims a string of" in problem, problem
    assert listed == expected


@pytest.mark.slow
@pytest.mark.parametrize("what, mutate, word", IGNORED[:4], ids=[c[0] for c in IGNORED[:4]])
def test_every_command_reads_a_run_whose_index_is_ignored(indexed_run, tmp_path, what, mutate, word):
    path = _with_index(indexed_run, tmp_path, mutate(_index(indexed_run)))
    check_all_commands(path, STILL_VALID)
    assert check_api(path) is True


# (id, a change of the recorded index that keeps it well-formed, words of the refusal)
WRONG = [
    ("one row too few", lambda e: e.update(rows=e["rows"] - 1), ("lists 3 rows, the group holds 4",)),
    ("a kind it lacks", lambda e: e["kinds"].pop("param_after"), ("lists kinds",)),
    ("state keys in another order", lambda e: e.update(state_keys=e["state_keys"][::-1]), ("state keys",)),
    ("another dtype", lambda e: e["kinds"].update(grad="float64"), ("torch_dtype float32", "float64")),
    ("a 1 GiB shape", lambda e: e["meta"].update(shape=[16384, 16384]), ("metadata differs",)),
    ("another param group", lambda e: e["meta"].update(group=0, index_in_group=99), ("metadata differs",)),
]


def _wrong(indexed_run, tmp_path, change) -> str:
    index = _index(indexed_run)
    change(_entry(index))
    path = _with_index(indexed_run, tmp_path, index)
    assert _listing(path)[1] is None  # well-formed: listed from it
    return path


@pytest.mark.parametrize("what, change, words", WRONG, ids=[c[0] for c in WRONG])
def test_an_index_wrong_about_a_parameter_is_refused_when_its_data_is_read(indexed_run, tmp_path, what, change,
                                                                            words):
    path = _wrong(indexed_run, tmp_path, change)
    with upd.open_run(path) as run:
        run.describe()  # listing reads only the index
        param = run.optimizers[0].param_records[P]
        with pytest.raises(upd.RunFileError) as refused:
            param.read(schema.KIND_GRAD, 0)
    message = str(refused.value)
    assert "\n" not in message and all(w in message for w in (path, P, *words)), message
    with upd.open_run(indexed_run) as run:  # the run as recorded reads
        assert run.optimizers[0].param_records[P].read(schema.KIND_GRAD, 0).shape == (12, 16)


@pytest.mark.slow
@pytest.mark.parametrize("what, change, words", WRONG, ids=[c[0] for c in WRONG])
def test_every_command_that_reads_data_refuses_an_index_wrong_about_a_parameter(indexed_run, tmp_path, what, change,
                                                                                 words):
    path = _wrong(indexed_run, tmp_path, change)
    codes = check_all_commands(path, READ_REFUSES, words=(P, "parameter index", *words), measure_memory=True)
    assert codes == {"info": 0, "analyze": 2, "verify": 2}
    assert check_api(path, words=(P, *words)) is False


@pytest.mark.slow
def test_every_command_reads_the_run_as_recorded(indexed_run):
    assert check_all_commands(indexed_run, STILL_VALID) == {"info": 0, "analyze": 0, "verify": 0}
    assert check_api(indexed_run) is True


def test_a_listed_parameter_behind_a_soft_link_is_refused_at_open(indexed_run, tmp_path):
    """The index lists names; the links to the groups are still checked when the run is opened."""
    path = _with_index(indexed_run, tmp_path, _index(indexed_run))
    with h5py.File(path, "r+") as f:
        f[f"{PARAMS}/moved"] = f[f"{PARAMS}/{P}"]
        del f[f"{PARAMS}/{P}"]
        f[f"{PARAMS}/{P}"] = h5py.SoftLink(f"{PARAMS}/moved")
        index = _index_of(f)
        index["params"].append(dict(_entry(index), key="moved"))
        f[PARAMS].attrs[schema.PARAM_INDEX] = json.dumps(index)
    with pytest.raises(upd.RunFileError, match="soft link"):
        upd.open_run(path)


def _index_of(f) -> dict:
    return json.loads(f[PARAMS].attrs[schema.PARAM_INDEX])
