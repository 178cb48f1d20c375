"""Recording under torch.compile: of the model, of ``optimizer.step``, or both. The run is the same as in eager mode
(names without torch.compile's ``_orig_mod.``, every step verifies), and the recorder's own work is never traced by
dynamo: its hooks run eagerly (``upd.recorder.backward.eager``).
"""
from __future__ import annotations

import pytest
import torch

import upd
from upd.recorder import recorder as recorder_module
from upd.recorder.naming import without_compile_prefix
from tests.harness.training import loss_at, mlp

NAMES = ["0.bias", "0.weight", "2.bias", "2.weight"]
STEPS = 4


# What the tests check (dynamo's tracing, the names, the recorded values) does not depend on the backend, so all but
# one case compile with aot_eager: inductor's C++ builds cost about 20 s of CPU per case on a fresh cache, as in CI.
CHEAP_BACKEND = "aot_eager"


def compiled_training(path, compile_model: bool, compile_step: bool, steps: int = STEPS, backend: str = CHEAP_BACKEND,
                      **options):
    """A recorded run of `steps` Adam steps, the model and/or the step compiled with `backend`; returns whether any
    of the recorder's step work ran while dynamo was tracing."""
    torch._dynamo.reset()
    model = mlp()
    run_model = torch.compile(model, backend=backend) if compile_model else model
    opt = torch.optim.Adam(run_model.parameters(), lr=1e-2)
    step = torch.compile(opt.step, backend=backend) if compile_step else opt.step
    traced = []
    before_step = recorder_module.Recorder._before_step

    def watched_before_step(self, *args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return before_step(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recorder_module.Recorder, "_before_step", watched_before_step)
        with upd.record(path, run_model, opt, **{"every": 1, **options}) as rec:
            for s in range(steps):
                opt.zero_grad()
                loss_at(run_model, s).backward()
                step()
    assert rec.error is None
    return any(traced)


def assert_verified(path, steps: int = STEPS) -> None:
    with upd.open_run(path) as run:
        assert sorted(run.optimizers[0].param_records) == NAMES
        assert run.optimizers[0].num_records == steps
        assert run.params_not_optimized == []
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


@pytest.mark.slow
@pytest.mark.parametrize("compile_model, compile_step, backend",
                         [(True, False, CHEAP_BACKEND), (False, True, CHEAP_BACKEND), (True, True, "inductor")],
                         ids=["model", "step", "both-inductor"])
def test_recording_under_compile_is_unchanged(tmp_path, compile_model, compile_step, backend):
    path = tmp_path / "compiled.h5"
    traced = compiled_training(path, compile_model, compile_step, backend=backend, stats_every=1)
    assert not traced
    assert_verified(path)


@pytest.mark.slow
def test_hooks_would_be_traced_without_eager(tmp_path, monkeypatch):
    """The control for the tests above: without `eager` around the hooks, dynamo traces the recorder's step work
    when optimizer.step is compiled (a 5.5x slowdown was seen before the hooks were excluded)."""
    monkeypatch.setattr(recorder_module, "eager", lambda hook: hook)
    assert compiled_training(tmp_path / "traced.h5", compile_model=False, compile_step=True, steps=2)


def test_compiled_submodule_names_have_no_prefix(tmp_path):
    """A submodule compiled in place puts `_orig_mod.` in the middle of its parameters' names; an optimizer built
    from a compiled model's named_parameters() has it in its param_names."""
    model = mlp()
    model[0] = torch.compile(model[0])  # never run here: compiling is lazy, the names are there already
    assert "0._orig_mod.weight" in dict(model.named_parameters())
    named = torch.optim.SGD(list(torch.compile(mlp()).named_parameters()), lr=0.1)
    path = tmp_path / "names.h5"
    with upd.record(path, model, [torch.optim.SGD(model.parameters(), lr=0.1), named], every=1):
        pass
    with upd.open_run(path) as run:
        for optimizer in run.optimizers:
            assert sorted(p["name"] for p in optimizer.meta["params"]) == NAMES


def test_without_compile_prefix():
    assert without_compile_prefix("_orig_mod.0.weight") == "0.weight"
    assert without_compile_prefix("module._orig_mod.layer._orig_mod.w") == "module.layer.w"
    assert without_compile_prefix("orig_mod_x._orig_modx.w") == "orig_mod_x._orig_modx.w"
