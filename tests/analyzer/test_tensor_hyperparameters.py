"""A tensor lr (torch accepts lr=torch.tensor([0.1])) is an lr like any other in every table."""
import math

import pytest
import torch
from torch import nn

import upd


@pytest.mark.parametrize("lr", [torch.tensor([0.1]), torch.tensor(0.1), 0.1], ids=["tensor1", "tensor0d", "float"])
def test_tensor_lr_shows_in_the_steps_and_ratio_tables(tmp_path, lr):
    path = str(tmp_path / "run.h5")
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with upd.record(path, model, opt, every=1):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
    with upd.open_run(path) as run:
        steps, ratios = run.steps(), run.ratios()
        assert steps["lr_group0"].tolist() == pytest.approx([0.1] * 3)
        assert ratios["lr"].tolist() == pytest.approx([0.1] * len(ratios))
        assert not any(math.isnan(v) for v in run.optimizers[0].learning_rates[:, 0])
    assert upd.verify(path).exit_code == 0
