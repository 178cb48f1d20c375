"""The user's own sink in docs/sinks.md runs as written, on a real training loop, and prints what it says."""
import os
import re

import torch
from torch import nn

import upd

from tests.harness.paths import SAMPLE_DIR
from tests.harness.training import MLP

DOCS = os.path.join(os.path.dirname(SAMPLE_DIR), "docs")


def test_the_ten_line_sink_of_sinks_md(tmp_path, capsys):
    with open(os.path.join(DOCS, "sinks.md")) as f:
        block = re.findall(r"```python\n(.*?)```", f.read(), re.S)[0]
    namespace = {}
    exec(block, namespace)
    sink = namespace["PrintRatios"]("fc1.weight")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, stats_every=10, sinks=[sink], every=1) as rec:
        g = torch.Generator().manual_seed(0)
        for _ in range(25):
            loss = nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))
            opt.zero_grad()
            loss.backward()
            rec.log(loss=loss)
            opt.step()
    printed = capsys.readouterr().out.splitlines()
    assert printed == sink.lines + ["3 steps"] and len(sink.lines) == 3
    with upd.open_run(path) as run:
        ratios = run.ratios().set_index(["param", "step"])
        losses = run.scalars().set_index("step")["loss"]
    for line, step in zip(sink.lines, (0, 10, 20)):
        assert line == (f"step {step}: update:data {ratios.loc[('fc1.weight', step), 'update_to_data']:.2f}, "
                        f"loss {losses[step]:.4f}")
