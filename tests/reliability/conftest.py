"""Fixtures the reliability tests share."""
import pytest
import torch

import upd
from tests.harness.training import MLP, train_steps


@pytest.fixture(scope="module")
def stats_run(tmp_path_factory):
    """A real statistics-only run (every=None, stats_every=1): the statistics table is the only data."""
    path = str(tmp_path_factory.mktemp("stats") / "stats.h5")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(path, model, opt, every=None, stats_every=1):
        train_steps(model, opt, steps=6)
    return path
