"""The wrapper registry: every kind of wrapper in one module, asked in priority order, and a new one added as
docs/distributed.md ("Adding a wrapper") shows: one Wrapper subclass, and the recorder names through it."""
from __future__ import annotations

import torch
from torch import nn

import upd
from upd.recorder import wrappers
from upd.recorder.wrappers import Wrapper, register, unregister
from upd.runfile import schema


class Wrapped(nn.Module):
    """A trainer's own module wrapper (as in the docs' example): it runs the model as `.inner`."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _train(path, model, optimizer):
    with upd.record(path, model, optimizer, strict=True, every=1):
        for _ in range(2):
            model(torch.randn(4, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def test_every_kind_is_registered_once_in_priority_order():
    names = [w.name for w in wrappers.wrappers()]
    assert len(names) == len(set(names))
    for kind in ("plain", "DistributedDataParallel", "torch.compile", "FSDP2 (DTensor)", "ZeroRedundancyOptimizer",
                 "DeepSpeed", "FullyShardedDataParallel (FSDP1)", "Accelerate / Lightning optimizer wrapper"):
        assert kind in names
    priorities = [w.priority for w in wrappers.wrappers()]
    assert priorities == sorted(priorities, reverse=True)
    assert wrappers.in_use([nn.Linear(2, 2)], [])[-1].parallelism == schema.REPLICATED


def test_a_new_wrapper_is_one_registered_class(tmp_path):
    model = nn.Linear(3, 2)
    wrapped = Wrapped(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    _train(str(tmp_path / "before.h5"), wrapped, optimizer)
    with upd.open_run(str(tmp_path / "before.h5")) as run:
        assert list(run.params()["param"]) == ["inner.weight", "inner.bias"]  # unknown: the wrapper's names

    @register
    class MyTrainerModule(Wrapper):  # the docs' worked example
        name = "MyTrainer Wrapped"

        def model_inside(self, model):
            return model.inner if isinstance(model, Wrapped) else None

    try:
        assert wrappers.model_inside(wrapped) is model
        _train(str(tmp_path / "after.h5"), wrapped, optimizer)
        with upd.open_run(str(tmp_path / "after.h5")) as run:
            assert list(run.params()["param"]) == ["weight", "bias"]  # the model's own names
    finally:
        unregister("MyTrainer Wrapped")
    assert wrappers.model_inside(wrapped) is wrapped
