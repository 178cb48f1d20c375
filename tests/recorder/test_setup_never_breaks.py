"""`upd.record` never breaks training at setup: wrapped optimizers (Accelerate's AcceleratedOptimizer, Lightning's
LightningOptimizer, any wrapper exposing the optimizer it wraps) are recorded through; anything it cannot record
gives one RecorderWarning, an inactive recorder and no file (an exception only with strict=True). Bad option values
and a refused overwrite still raise: they are programming errors the user sees before training starts.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import upd
from upd.recorder import recorder as recorder_module
from upd.recorder.wrappers import optimizer_inside
from tests.harness.training import loss_at, mlp, no_hooks_left, params_of, train

NAMES = ["0.bias", "0.weight", "2.bias", "2.weight"]


def recorder_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, upd.RecorderWarning)]


def record_warning_once(*args, **options):
    """upd.record(...) and the RecorderWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = upd.record(*args, **{"every": 1, **options})
    return rec, recorder_warnings(caught)


def assert_verified_run(path, steps: int) -> None:
    with upd.open_run(path) as run:
        assert sorted(run.optimizers[0].param_records) == NAMES
        assert run.optimizers[0].num_records == steps
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


# -- wrappers: recorded through ---------------------------------------------------------------------------------
class OptimizerWrapper:
    """A wrapper as Accelerate's and others: not an Optimizer, exposes the one it wraps as `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self, closure=None):
        return self.optimizer.step(closure)


class LightningLikeOptimizer(OptimizerWrapper):
    """Lightning's LightningOptimizer keeps it in `._optimizer`, with an `optimizer` property."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def optimizer(self):
        return self._optimizer


class UninitialisedSubclass(torch.optim.Optimizer):
    """Like AcceleratedOptimizer: a torch.optim.Optimizer subclass that never ran Optimizer.__init__ (no hooks)."""

    def __init__(self, optim):
        self.optim = optim

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad()

    def step(self, closure=None):
        return self.optim.step(closure)


@pytest.mark.parametrize("wrap", [OptimizerWrapper, LightningLikeOptimizer, UninitialisedSubclass,
                                  lambda opt: OptimizerWrapper(LightningLikeOptimizer(opt))],
                         ids=["optimizer", "lightning-like", "uninitialised-subclass", "nested"])
def test_wrapped_optimizer_is_recorded_through(tmp_path, wrap):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    wrapper = wrap(opt)
    assert optimizer_inside(wrapper) is opt
    path = tmp_path / "wrapped.h5"
    rec, warned = record_warning_once(path, model, wrapper)
    with rec:
        assert warned == [] and rec.active and rec.optimizers == [opt]
        train(model, wrapper, 3)
    assert no_hooks_left(opt, model)
    assert_verified_run(path, 3)


def test_wrapper_lookup_stops_at_cycles_and_non_optimizers():
    a, b = OptimizerWrapper(None), OptimizerWrapper(None)
    a.optimizer, b.optimizer = b, a  # neither wraps an Optimizer: nothing to find, and no endless loop
    assert optimizer_inside(a) is a

    class Raising:
        @property
        def optimizer(self):
            raise RuntimeError("someone else's property")
    raising = Raising()
    assert optimizer_inside(raising) is raising
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    assert optimizer_inside(opt) is opt


@pytest.fixture
def accelerator():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (it is a test extra)")
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    yield acc
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_prepared_optimizer_is_recorded(tmp_path, accelerator):
    """The case from the issue: Accelerator().prepare() returns an AcceleratedOptimizer, which has no step hooks of
    its own. With gradient accumulation of 2, every second batch steps: each record counts two backward passes."""
    model = mlp()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    path = tmp_path / "accelerate.h5"
    rec, warned = record_warning_once(path, model, opt)
    with rec:
        assert warned == [] and rec.active and isinstance(rec.optimizers[0], torch.optim.AdamW)
        for s in range(6):
            with accelerator.accumulate(model):
                accelerator.backward(loss_at(model, s))
                opt.step()
                opt.zero_grad()
    assert no_hooks_left(rec.optimizers[0], model)
    assert_verified_run(path, 3)
    with upd.open_run(path) as run:
        assert np.diff(run.optimizers[0].backward_passes).tolist() == [2, 2]


# -- what cannot be recorded: one warning, nothing recorded, training goes on --------------------------------------
NOT_RECORDABLE = {
    "not an optimizer": lambda model: (model, object()),
    "no optimizer": lambda model: (model, None),
    "the model as optimizer": lambda model: (model, model),
    "an optimizer without hooks": lambda model: (model, UninitialisedSubclass(None)),
    "model not a module": lambda model: ("not a model", torch.optim.SGD(model.parameters(), lr=0.1)),
}


@pytest.mark.parametrize("case", list(NOT_RECORDABLE))
def test_cannot_record_warns_once_and_training_goes_on(tmp_path, case):
    model = mlp()
    model_arg, opt_arg = NOT_RECORDABLE[case](model)
    path = tmp_path / "run.h5"
    rec, warned = record_warning_once(path, model_arg, opt_arg, stats_every=1)
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert "cannot record" in message and "training continues" in message and "strict=True" in message
    assert warned[0].filename == __file__  # points at the user's upd.record call
    assert not rec.active and isinstance(rec.error, TypeError) and rec.records == 0
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
    opt = opt_arg if isinstance(opt_arg, torch.optim.SGD) else torch.optim.SGD(model.parameters(), lr=0.1)
    before = params_of(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec:
            train(model, opt, 2)
        rec.close()
    assert recorder_warnings(caught) == []
    assert not torch.equal(before["0.weight"], model[0].weight)  # trained
    assert no_hooks_left(opt, model)


@pytest.mark.parametrize("case", list(NOT_RECORDABLE))
def test_strict_raises_what_cannot_be_recorded(tmp_path, case):
    model_arg, opt_arg = NOT_RECORDABLE[case](mlp())
    with pytest.raises(TypeError):
        upd.record(tmp_path / "run.h5", model_arg, opt_arg, strict=True, every=1)
    assert os.listdir(tmp_path) == []


def test_bad_option_values_still_raise_before_anything_else(tmp_path):
    """A bad option is a programming error seen before training starts: raised, even when the optimizer could not
    be recorded either."""
    with pytest.raises(ValueError, match="every must be a positive integer"):
        upd.record(tmp_path / "run.h5", mlp(), object(), every=-1)
    with pytest.raises(ValueError, match="overwrite=True or resume=True"):
        upd.record(tmp_path / "run.h5", mlp(), object(), overwrite=True, resume=True, every=1)
    assert os.listdir(tmp_path) == []


def test_existing_file_is_still_refused_through_a_wrapper(tmp_path):
    path = tmp_path / "exists.h5"
    path.write_bytes(b"precious")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FileExistsError):
        upd.record(path, model, OptimizerWrapper(opt), every=1)
    assert path.read_bytes() == b"precious" and no_hooks_left(opt, model)


# -- a failure after the file was created removes it ----------------------------------------------------------
def failing_add_optimizer(self, index, meta):
    raise OSError("disk gone")


def test_setup_failing_after_creating_the_file_leaves_no_stub(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder_module.AsyncRunWriter, "add_optimizer", failing_add_optimizer)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path / "run.h5"
    rec, warned = record_warning_once(path, model, opt)
    assert len(warned) == 1 and "disk gone" in str(warned[0].message)
    assert not rec.active and not os.path.exists(path) and no_hooks_left(opt, model)
    with rec:
        train(model, opt, 2)
    with pytest.raises(OSError, match="disk gone"):
        upd.record(path, model, opt, strict=True, every=1)
    assert not os.path.exists(path)


def test_failing_resume_setup_keeps_the_users_run(tmp_path, monkeypatch):
    """Resuming appends to the user's file: a setup failure never removes it (the control for the test above)."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path / "run.h5"
    with upd.record(path, model, opt, every=1):
        train(model, opt, 2)
    monkeypatch.setattr(recorder_module.AsyncRunWriter, "add_optimizer", failing_add_optimizer)
    rec, warned = record_warning_once(path, model, opt, resume=True)
    assert len(warned) == 1 and not rec.active
    monkeypatch.undo()
    assert_verified_run(path, 2)
