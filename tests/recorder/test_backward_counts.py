"""Backward passes counted by builtin hooks (``list.append``) with one Python hook (the sentinel) per recorder: the
counts stay exact per parameter, and the end-of-backward norm is measured at every pass that reaches the sentinel;
a pass that does not (the sentinel's parameter unused) misses that step's backward norm only, and the sentinel moves
to a parameter every pass reaches."""
import numpy as np
import torch
import torch.nn as nn

import upd
from upd.runfile import schema


class TwoHeads(nn.Module):
    """A trunk and two heads; `head` picks the one a pass uses, so the other's parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)  # first: the sentinel to begin with
        self.trunk = nn.Linear(6, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x, head):
        return (self.a if head == "a" else self.b)(torch.tanh(self.trunk(x)))


def test_counts_are_exact_and_the_backward_norm_follows_a_sentinel_that_moves(tmp_path):
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    heads = ["a", "a", "b", "b", "b", "a"]  # steps 2-4 never reach head a's parameters
    path = str(tmp_path / "run.h5")
    norms_seen = []
    with upd.record(path, model, opt, every=None, stats_every=1) as rec:
        for head in heads:
            opt.zero_grad()
            model(x, head).pow(2).mean().backward()
            norms_seen.append(float(torch.linalg.vector_norm(torch.stack(
                [p.grad.norm() for p in model.parameters() if p.grad is not None]))))
            opt.step()
        counts = rec._backward._counts
        assert counts[id(model.trunk.weight)] == 6 and counts[id(model.a.weight)] == 3 \
            and counts[id(model.b.weight)] == 3
    with upd.open_run(path) as run:
        scalars = run.scalars().set_index("step")
        steps = run.steps()
    assert list(steps["backward_pass"]) == [1, 2, 3, 4, 5, 6]  # the most any parameter saw
    backward = scalars[schema.SCALAR_GRAD_NORM_BACKWARD].reindex(range(6)).to_numpy()
    # step 2: the first pass without the sentinel (head a's weight): no norm; the fold at step 2's pre-hook moves
    # the sentinel to the parameter that pass accumulated last, and every later pass reaches it
    assert np.isnan(backward[2])
    measured = [s for s in range(6) if s != 2]
    np.testing.assert_allclose(backward[measured], np.asarray(norms_seen)[measured], rtol=1e-5)
