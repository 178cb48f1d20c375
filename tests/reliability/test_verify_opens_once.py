"""`upd verify` opens a parameter once, not once per state key its index entry lists: a refused open is remembered
(ParamRecord._open_listed). Before, an entry listing 20,000 state keys gave 20,001 opens of the parameter's group
(22.7 s), 100,000 keys 96 s before refusing, where analyze refused in 2.3 s."""
import json
import shutil

import h5py
import pytest
import upd
from upd.runfile import schema
from upd.runfile.reader import ParamRecord

from tests.harness.paths import SAMPLE_DIR

PARAMS = schema.PARAMS_GROUP.path(k=0)
KEYS = 2000  # counts, not seconds: main opened the group KEYS + 1 times


def test_verify_opens_a_parameter_once_whatever_its_index_lists(tmp_path, monkeypatch):
    path = str(tmp_path / "many-keys.h5")
    shutil.copy(f"{SAMPLE_DIR}/adam.h5", path)  # a real run with the index its recorder wrote
    with h5py.File(path, "r+") as f:
        index = json.loads(f[PARAMS].attrs[schema.PARAM_INDEX])
        for entry in index["params"]:
            entry["state_keys"] = entry["state_keys"] + [f"k{i}" for i in range(KEYS)]
        f[PARAMS].attrs[schema.PARAM_INDEX] = json.dumps(index)
    opens = []
    load = ParamRecord._load
    monkeypatch.setattr(ParamRecord, "_load", lambda self, group: (opens.append(self.name), load(self, group))[1])
    with pytest.raises(upd.RunFileError, match="state keys"):
        upd.verify(path)
    assert opens and max(opens.count(name) for name in set(opens)) == 1, len(opens)
