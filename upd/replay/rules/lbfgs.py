"""torch.optim.LBFGS: recorded faithfully, never replayed.

One LBFGS step() runs up to max_iter iterations, each re-evaluating the closure (the model) at new points, with an
optional strong-Wolfe line search, over the flattened parameters of the whole model, using history lists (old_dirs,
old_stps, ro) that have no fixed tensor shape. None of that can be recomputed from one parameter's record, so the
rule says so for every step instead of guessing: `upd verify` reports the steps as skipped with this reason, and
exits 3 when nothing else in the run is verifiable.
"""
import torch

from ..registry import NotReplayable, register


@register(torch.optim.LBFGS, needs_whole_tensor=True)
def lbfgs(param, grad, state, group, step):
    search = group.get("line_search_fn") or "no line search"
    raise NotReplayable(
        f"LBFGS re-evaluates the model up to max_iter={group.get('max_iter')} times inside one step ({search}) "
        "over all parameters at once: not replayable from the record (the closure losses are recorded)")
