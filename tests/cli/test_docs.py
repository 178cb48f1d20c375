"""The examples in the docs run as written."""
import os
import re
import sys

import h5py
import torch

import upd
from upd.runfile import schema

from tests.harness.paths import SAMPLE_DIR
from tests.harness.training import MLP, train_steps

DOCS = os.path.join(os.path.dirname(SAMPLE_DIR), "docs")


def python_blocks(name):
    with open(os.path.join(DOCS, name)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_third_party_rule_from_verify_md(tmp_path):
    namespace = {}
    exec(python_blocks("verify.md")[0], namespace)
    Lion = namespace["Lion"]
    try:
        torch.manual_seed(0)
        model = MLP()
        opt = Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
        path = str(tmp_path / "lion.h5")
        with upd.record(path, model, opt, every=1):
            train_steps(model, opt, steps=4)
        report = upd.verify(path)
        assert report.exit_code == 0, report.summary()
        assert report.matched == 16 and report.checks["state_checked"].sum() == 12
        with h5py.File(path, "r+") as f:  # and the documented rule still catches a wrong lr
            f[schema.RECORD_TABLE.at(schema.HPARAMS, k=0)][1] = f[schema.RECORD_TABLE.at(schema.HPARAMS, k=0)][1].decode().replace(
                '"lr": 0.001', '"lr": 0.0011')
        assert upd.verify(path).exit_code == 1
    finally:
        upd.replay.unregister(Lion)


def test_reading_by_hand_from_format_md(tmp_path):
    torch.manual_seed(0)
    model = MLP(n_in=64, n_hidden=20, n_out=10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with upd.record("run.h5", model, opt, every=1):
            train_steps(model, opt, steps=3, n_in=64, n_out=10)
        namespace = {}
        exec(python_blocks("format.md")[0], namespace)
    finally:
        os.chdir(cwd)
    assert namespace["committed"] == 3 and namespace["step"] == 2 and namespace["lr"] == 1e-3
    assert namespace["w"].shape == (20, 64) and namespace["m"].abs().sum() > 0


def test_cli_loads_rules_from_a_module(tmp_path, monkeypatch):
    """`upd verify --rules MODULE` imports a module that registers a rule for an optimizer defined there."""
    from click.testing import CliRunner

    from upd.cli.main import main

    module = tmp_path / "lion_rules.py"
    module.write_text(python_blocks("verify.md")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    Lion = importlib.import_module("lion_rules").Lion
    try:
        torch.manual_seed(0)
        model = MLP()
        opt = Lion(model.parameters(), lr=1e-3)
        path = str(tmp_path / "lion.h5")
        with upd.record(path, model, opt, every=1):
            train_steps(model, opt, steps=2)
        upd.replay.unregister(Lion)  # as in a fresh `upd` process, which knows no Lion rule
        sys.modules.pop("lion_rules")
        assert CliRunner().invoke(main, ["verify", path]).exit_code == 3
        result = CliRunner().invoke(main, ["verify", "--rules", "lion_rules", path])
        assert result.exit_code == 0, result.output
        result = CliRunner().invoke(main, ["verify", "--rules", "no_such_module_xyz", path])
        assert result.exit_code == 2 and "could not load replay rules" in result.output
    finally:
        upd.replay.unregister(Lion)


def test_every_pip_install_in_the_docs_installs_from_a_clone():
    """torch-upd is not published on PyPI: `pip install "torch-upd[x]"` fails for every reader. Every install line
    in README.md and docs/ names the clone ("." with an extra pyproject.toml declares) or a third-party package."""
    import tomllib

    root = os.path.dirname(DOCS)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    texts = {"README.md": open(os.path.join(root, "README.md")).read()}
    texts.update({f"docs/{n}": open(os.path.join(DOCS, n)).read() for n in os.listdir(DOCS) if n.endswith(".md")})
    lines = [(name, line) for name, text in texts.items() for line in re.findall(r"pip install[^`\n]*", text)]
    assert lines
    for name, line in lines:
        assert "torch-upd" not in line and "torch_upd" not in line, (name, line)
        for extra in re.findall(r"\.\[([a-z,]+)\]", line):
            assert set(extra.split(",")) <= extras, (name, line)
