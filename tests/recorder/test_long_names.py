"""A parameter name is at most schema.MAX_NAME_CHARS characters in a run file: the recorder shortens a longer one
(its start and end around a marker with its length and a hash), warns, and records it; training is untouched."""
import warnings

import torch
from torch import nn

import upd
from upd.runfile.schema import MAX_NAME_CHARS

LONG = "x" * 1_000_000


def test_a_1_mb_name_is_recorded_shortened_with_a_marker_and_a_warning(tmp_path):
    torch.manual_seed(0)
    model = nn.Module()
    model.p = nn.ParameterDict({"short": nn.Parameter(torch.randn(2, 2)), LONG: nn.Parameter(torch.randn(3)),
                                LONG[:-1] + "y": nn.Parameter(torch.randn(3))})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "long.h5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, model, opt, every=1, stats_every=1) as rec:
            for _ in range(2):
                opt.zero_grad()
                sum((p ** 2).sum() for p in model.parameters()).backward()
                opt.step()
        assert rec.error is None
    shortened = [w for w in caught if "1000002 characters" in str(w.message) or "1000000 characters" in str(w.message)]
    assert len(shortened) >= 2 and all(len(str(w.message)) < 400 for w in shortened)
    with upd.open_run(path) as run:
        names = run.params()["param"].tolist()
        assert run.optimizers[0].num_records == 2
    assert "p.short" in names and len(names) == 3 and max(map(len, names)) == MAX_NAME_CHARS
    long_names = [n for n in names if len(n) == MAX_NAME_CHARS]
    assert len(set(long_names)) == 2  # two names that differ only at the end stay two parameters
    assert all(n.startswith("p.xxxx") and "1000002 characters, sha256 " in n for n in long_names)
