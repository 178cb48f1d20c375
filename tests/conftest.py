import os
import shutil

import pytest
import torch
from torch import nn

import upd

SAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_runs")
SAMPLE_RUNS = sorted(os.path.join(SAMPLE_DIR, f) for f in os.listdir(SAMPLE_DIR) if f.endswith(".h5"))


class MLP(nn.Module):
    def __init__(self, n_in=16, n_hidden=12, n_out=4):
        super().__init__()
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.fc2 = nn.Linear(n_hidden, n_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def train_steps(model, optimizer, steps=4, seed=0, n_in=16, n_out=4, after_step=None, scheduler=None):
    """A real little training loop on random regression data."""
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(8, n_in, generator=g)
        y = torch.randn(8, n_out, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(i)


def record_run(path, make_optimizer, steps=4, seed=0, **record_options):
    torch.manual_seed(seed)
    model = MLP()
    optimizer = make_optimizer(model)
    with upd.record(path, model, optimizer, **record_options):
        train_steps(model, optimizer, steps=steps, seed=seed)
    return path


@pytest.fixture
def sample_copy(tmp_path):
    """A writable copy of a committed sample run."""
    def copy(name):
        dst = tmp_path / name
        shutil.copy(os.path.join(SAMPLE_DIR, name), dst)
        return str(dst)
    return copy
