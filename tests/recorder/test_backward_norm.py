"""The total gradient norm at the end of the backward pass, measured only while it can differ from the step's
(grad_norms.BackwardNorm): trusted after TRUST_AFTER steps whose gradients nothing changed, measured again from the
first step that finds them changed, and never trusted where a write through ``.data`` changes them unseen by their
version counters."""
import math

import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.analyzer.clipping import clipping_by_step
from upd.recorder import grad_norms
from upd.runfile import schema

STEPS = grad_norms.TRUST_AFTER + 12


def train(path, change=None, steps=STEPS, **options):
    """A small MLP trained with AdamW and lean statistics at every step; `change(step, model)` runs between backward
    and step. Returns each step's total gradient norm at the end of its backward pass and as its step saw it, and how
    many backward passes measured a norm of their own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    backward, at_step = [], []
    measured = []

    def total():
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    real_call = grad_norms.TotalNorm.__call__

    def counting(self, tensors):
        measured.append(1)
        return real_call(self, tensors)
    grad_norms.TotalNorm.__call__ = counting
    try:
        with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=None, **options):
            for step in range(steps):
                opt.zero_grad()
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
                nn.functional.mse_loss(model(x), y).backward()
                backward.append(total())
                if change is not None:
                    change(step, model)
                at_step.append(total())
                opt.step()
    finally:
        grad_norms.TotalNorm.__call__ = real_call
    with upd.open_run(path) as run:
        scalars = run.scalars().set_index("step").reindex(range(steps))
    return backward, at_step, len(measured), scalars


def test_unchanged_gradients_give_the_steps_norm_without_a_pass_of_their_own(tmp_path):
    backward, at_step, measured, scalars = train(str(tmp_path / "run.h5"))
    assert backward == at_step
    # measured (and compared with the step's) for TRUST_AFTER steps, then taken from the step's statistics
    assert measured == grad_norms.TRUST_AFTER
    assert scalars[schema.SCALAR_GRAD_NORM_BACKWARD].tolist() == pytest.approx(backward, rel=1e-5)
    assert scalars[schema.SCALAR_GRAD_NORM_AT_STEP].tolist() == pytest.approx(at_step, rel=1e-5)
    assert not clipping_by_step(scalars.reset_index())["clipped"].any()


def test_clipping_that_starts_late_is_measured_from_its_second_step(tmp_path):
    """The first clipped step after the norms were trusted has no backward norm (the gradients are clipped by the
    time the step sees their version counters moved); every later step measures it again."""
    first = STEPS - 6

    def clip(step, model):
        if step >= first:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    backward, at_step, measured, scalars = train(str(tmp_path / "run.h5"), change=clip)
    recorded = scalars[schema.SCALAR_GRAD_NORM_BACKWARD].to_numpy()
    assert np.isnan(recorded[first])
    later = list(range(first + 1, STEPS))
    assert recorded[later].tolist() == pytest.approx([backward[s] for s in later], rel=1e-5)
    assert recorded[:first].tolist() == pytest.approx(backward[:first], rel=1e-5)
    assert measured == grad_norms.TRUST_AFTER + len(later)
    by_step = clipping_by_step(scalars.reset_index()).set_index("step")
    assert by_step["clipped"].to_dict() == {s: s > first for s in range(STEPS) if s != first}


def test_a_write_through_data_is_caught_by_comparing_the_norms(tmp_path):
    """p.grad.data.mul_() does not move the gradient's version counter: the first step compares both norms, finds
    them unequal, and the norm is measured at every backward pass from then on (clipping shows at every step)."""
    def shrink(step, model):
        for p in model.parameters():
            p.grad.data.mul_(0.3)
    backward, at_step, measured, scalars = train(str(tmp_path / "run.h5"), change=shrink)
    assert measured == STEPS
    assert scalars[schema.SCALAR_GRAD_NORM_BACKWARD].tolist() == pytest.approx(backward, rel=1e-5)
    assert scalars[schema.SCALAR_GRAD_NORM_AT_STEP].tolist() == pytest.approx(at_step, rel=1e-5)
    assert clipping_by_step(scalars.reset_index())["clipped"].all()
    assert all(math.isclose(s, 0.3 * b, rel_tol=1e-5) for s, b in zip(at_step, backward))


def test_gradients_dropped_before_a_step_are_freed(tmp_path):
    """A backward pass whose step is skipped (a bad batch: zero_grad and go on) leaves nothing held: the versions
    noted at its end refer to the gradients weakly."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with upd.record(str(tmp_path / "run.h5"), model, opt, every=None, stats_every=1):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
        model(torch.randn(4, 64)).pow(2).mean().backward()  # this step is skipped
        dropped = weakref.ref(model.weight.grad)
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert dropped() is None
