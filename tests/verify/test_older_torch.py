"""`import upd` works on a torch without the newest optimizers (torch.optim.Adafactor, torch.optim.Muon: added in
2.5 and 2.9): their replay rules are registered by class name, never by attribute."""
import os
import subprocess
import sys

import pytest
import torch

import upd
from upd.replay.registry import registered

from tests.harness.paths import REPO_ROOT

SCRIPT = """
import torch
del torch.optim.Adafactor, torch.optim.Muon   # as on an older torch
import upd
from tests.harness.training import record_run
path = record_run(__import__("sys").argv[1], lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), steps=2)
assert upd.verify(path).exit_code == 0
print("ok")
"""


@pytest.mark.slow
def test_import_upd_without_adafactor_and_muon(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run.h5")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_their_rules_are_still_found_on_a_torch_that_has_them(tmp_path):
    assert {"torch.optim.Adafactor", "torch.optim.Muon"} <= set(registered())
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    opt = torch.optim.Adafactor([weight], lr=1e-2)
    path = tmp_path / "adafactor.h5"
    with upd.record(path, optimizer=opt, every=1):
        for _ in range(3):
            opt.zero_grad()
            (weight ** 2).sum().backward()
            opt.step()
    assert upd.verify(path).matched > 0
