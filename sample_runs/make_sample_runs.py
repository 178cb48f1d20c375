"""Regenerate the committed sample runs: `python sample_runs/make_sample_runs.py [OUT_DIR]`.

Deterministic: fixed seeds, CPU, single thread. The recorded tensors are identical on every run of the same torch
version; only the timestamps in the files differ. Each run stays well under 2 MB.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

import upd

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 20


class MLP(nn.Module):
    """The seed answer's network: MLP(64, 20, 10)."""

    def __init__(self, n_in=64, n_hidden=20, n_out=10):
        super().__init__()
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.fc2 = nn.Linear(n_hidden, n_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 64, generator=g)
    y = torch.randn(256, 10, generator=g)
    return x, y


def _train(path, model, optimizer, scheduler=None, seed=0):
    x, y = _data(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with upd.record(path, model, optimizer, overwrite=True) as rec:
        for _ in range(STEPS):
            idx = torch.randint(0, len(x), (32,), generator=g)
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            rec.log(loss=loss)  # the run's scalars table: run.steps() shows the loss next to the lr
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return path


def sgd_momentum(out_dir):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    return _train(os.path.join(out_dir, "sgd_momentum.h5"), model, opt)


def adam(out_dir):
    torch.manual_seed(1)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return _train(os.path.join(out_dir, "adam.h5"), model, opt)


def adamw_scheduler_two_groups(out_dir):
    torch.manual_seed(2)
    model = MLP()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    # The usual split: decay the matrices, not the biases, and give the biases their own lr.
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.05},
                             {"params": others, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 3e-2], total_steps=STEPS)
    return _train(os.path.join(out_dir, "adamw_onecycle_two_groups.h5"), model, opt, sched)


ALL = (sgd_momentum, adam, adamw_scheduler_two_groups)


def main(out_dir=HERE):
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    for make in ALL:
        path = make(out_dir)
        print(f"{path}: {os.path.getsize(path) / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
