"""upd.record's options are declared once (upd.recorder.options.RecordOptions): upd.record's signature, the
launcher's flags, the README's list and the run's stored options all follow that declaration."""
import ast
import dataclasses
import inspect
import os
import re

import pytest
import torch

import upd
from upd.cli.record import FLAGS, record as record_command
from upd.recorder.options import RecordOptions, fields

from tests.harness.paths import SAMPLE_DIR
from tests.harness.training import MLP, train_steps

README = os.path.join(os.path.dirname(SAMPLE_DIR), "README.md")


def declared() -> dict:
    return {f.name: f.default for f in fields()}


def readme_options() -> dict:
    """The keyword arguments of the README's `rec = upd.record(path, model, optimizer, ...)` block, in order."""
    with open(README) as f:
        text = f.read()
    block = re.search(r"rec = (upd\.record\(path, model, optimizer,.*?\))\s*#[^\n]*\n\.\.\.", text, re.S).group(1)
    call = ast.parse("\n".join(line.split("#")[0] for line in block.splitlines())).body[0].value
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def test_upd_record_shows_every_option_with_its_default():
    for function in (upd.record, upd.Recorder):
        params = inspect.signature(function).parameters
        options = {name: p.default for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert options == declared()
        assert list(params)[:3] == ["path", "model", "optimizer"]
    assert "stats_every: 'int | None' = None" in str(inspect.signature(upd.record))


def test_the_readme_lists_the_declared_options_in_order():
    listed = readme_options()
    assert list(listed) == list(declared())
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in listed.items()} == declared()


def test_the_launcher_has_one_flag_per_option_a_command_line_can_give():
    flags = [p.name for p in record_command.params if isinstance(p, __import__("click").Option)]
    assert flags[:len(FLAGS)] == [f.name for f in FLAGS]
    assert set(declared()) - set(flags) == {"sinks"}  # objects: Python only


def test_an_unknown_option_names_itself_and_a_bad_value_is_refused(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'evry'"):
        upd.record(str(tmp_path / "a.h5"), model, opt, evry=2, every=1)
    with pytest.raises(ValueError, match="stats_every must be a positive integer"):
        RecordOptions(stats_every=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RecordOptions().every = 3
    assert not os.listdir(tmp_path)


def test_the_run_stores_the_options_it_stored_before(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=2, include="fc1.*", what="param", tensorboard=None) as rec:
        train_steps(model, opt, steps=2)
    with upd.open_run(path) as run:
        stored = run.meta["options"]
    assert stored == {"every": 2, "stats_every": None, "zero_counts": ["grad"], "full_stats_every": 100,
                      "stats_sample": None, "flight_recorder": None, "spike_factor": 10.0, "include": ["fc1.*"],
                      "exclude": [], "what": ["param"], "dtype": "keep", "compression": None, "alerts": None}
