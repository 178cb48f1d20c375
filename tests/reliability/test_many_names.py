"""Many statistics-only names (issue 21): `upd info` on 1.1M of them (a 12 MB file) took 43 s and 1.28 GB, and
`upd analyze --no-plots` on 5,000 took 68 s. The costs are counted here, not timed: the statistics table's
attributes parsed once per open, info lists a bounded number of parameters and cleans only what it prints, and the
statistics DataFrame is built once per optimizer, not a frame and four column inserts per parameter."""
from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

import upd
from upd.cli.info import INFO_PARAM_ROWS
from upd.cli.main import main
from upd.runfile import encoding, schema
from upd import safe_text

NAMES = 3000


@pytest.fixture(scope="module")
def many_names(tmp_path_factory, stats_run):
    """The real statistics-only run's table given NAMES parameters (one step of values each, stored)."""
    path = str(tmp_path_factory.mktemp("names") / "names.h5")
    shutil.copy(stats_run, path)
    with h5py.File(path, "r+") as f:
        st = f[schema.STATS_TABLE.path(k=0)]
        columns = json.loads(st.attrs[schema.STATS_COLUMNS])
        names = [f"p{i}" for i in range(NAMES)]
        st.attrs[schema.STATS_PARAMS] = json.dumps(names)
        st.attrs[schema.STATS_PARAM_META] = json.dumps({n: {"group": 0, "index_in_group": i}
                                                        for i, n in enumerate(names)})
        old = st[schema.VALUES]
        steps, attrs, dtype = old.shape[0], dict(old.attrs), old.dtype
        del st[schema.VALUES]
        rng = np.random.default_rng(0)
        ds = st.create_dataset(schema.VALUES, data=rng.random((steps, NAMES, len(columns))).astype(dtype))
        for k, v in attrs.items():
            ds.attrs[k] = v
    return path


def test_info_parses_each_attribute_once_and_lists_a_bounded_number_of_names(many_names, monkeypatch):
    parsed, cleaned = [], [0]
    real_from_json, real_clean = encoding.from_json, safe_text.terminal_safe_data

    def counting_from_json(text):
        parsed.append(len(text))
        return real_from_json(text)

    def counting_clean(value):
        cleaned[0] += 1
        return real_clean(value)

    monkeypatch.setattr(encoding, "from_json", counting_from_json)
    monkeypatch.setattr("upd.cli.info.terminal_safe_data", counting_clean)
    result = CliRunner().invoke(main, ["info", many_names])
    assert result.exit_code == 0, result.output
    big = [n for n in parsed if n > 5 * NAMES]  # the names and their metadata: parsed at the open, not again
    assert len(big) == 2, big
    assert cleaned[0] < 200, cleaned  # the few fields info prints whole, not every name (recursion counted)
    rows = [line for line in result.output.splitlines() if line.lstrip()[:2] == "p0" or line.lstrip()[1:2].isdigit()
            and line.lstrip()[0] == "p"]
    assert len(rows) == INFO_PARAM_ROWS and rows[0].split()[0] == "p0"
    assert f"and {NAMES - INFO_PARAM_ROWS} more parameters" in result.output
    wide = CliRunner().invoke(main, ["info", many_names, "--wide"]).output
    assert sum(line.lstrip()[:1] == "p" and line.lstrip()[1:2].isdigit() for line in wide.splitlines()) == NAMES and "more parameters" not in wide


def test_the_statistics_frame_is_built_once_not_per_parameter(many_names, monkeypatch):
    inserts, concatenated = [0], []
    real_insert, real_concat = pd.DataFrame.insert, pd.concat

    def counting_insert(self, *args, **kwargs):
        inserts[0] += 1
        return real_insert(self, *args, **kwargs)

    def counting_concat(objs, *args, **kwargs):
        objs = list(objs)
        concatenated.append(len(objs))
        return real_concat(objs, *args, **kwargs)

    parsed = []
    real_from_json = encoding.from_json

    def counting_from_json(text):
        parsed.append(len(text))
        return real_from_json(text)

    with upd.open_run(many_names) as run:
        steps = len(run.optimizers[0].committed_stats_steps())
        monkeypatch.setattr(pd.DataFrame, "insert", counting_insert)
        monkeypatch.setattr(pd, "concat", counting_concat)
        monkeypatch.setattr(encoding, "from_json", counting_from_json)
        frame = run.stats()
    assert len(frame) == NAMES * steps and frame["param"].iloc[-1] == f"p{NAMES - 1}"
    assert inserts[0] == 0 and all(n <= 1 for n in concatenated), (inserts, concatenated)
    assert not [n for n in parsed if n > 5 * NAMES], parsed  # the names and their metadata: parsed at the open
