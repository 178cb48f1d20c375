"""Replay the small parameters of one param group together, as one flat tensor, instead of one at a time.

A model has many small parameters (biases, norm scales) next to a few large weights. Replayed one by one, each small
parameter costs a fixed price per recorded step (a few hundred torch operations on a few hundred elements): on a
small transformer its 50 small parameters took a quarter of verify's replay time for 0.4% of the elements. An
elementwise rule gives each element the same result whether it is replayed alone or next to other elements with the
same hyperparameters and the same scalar state, so the parameters of one param group that share their records are
concatenated per step (foreach-style), replayed with one call of the rule, and compared segment by segment: every
parameter keeps its own tolerance scale (its largest replayed update), errors, resolved counts and continuity check,
with the same per-element arithmetic as the one-by-one path (blocks.py), so the checks are the same numbers.

Only the common case is batched. Whatever would need care goes back to the one-by-one path, which stays the
reference: a scalar state entry (Adam's step) that differs between the parameters, state present for some of them
only, a non-finite value anywhere in a step, a rule that raises, and every parameter with a step that does not
match (its explanation comes from the one-by-one path, which replays the usual suspects on it).
"""
from __future__ import annotations

import torch

from . import blocks
from .registry import NotReplayable

# Parameters of at most this many elements are batched: above it a parameter's own arithmetic outweighs its fixed
# cost, and its chunked replay (blocks.CHUNK_ELEMENTS) is already as fast.
BATCH_ELEMENTS = 1 << 12


class Fallback(Exception):
    """The batch cannot be replayed as one: its parameters go back to the one-by-one path."""


def _segment_max(values: torch.Tensor, segments: torch.Tensor, count: int) -> torch.Tensor:
    """The maximum of `values` (finite, float64) over each of `count` segments (segments: segment index per
    element; every segment non-empty)."""
    return torch.zeros(count, dtype=values.dtype).scatter_reduce_(0, segments, values, "amax", include_self=False)


def _segment_count(mask: torch.Tensor, segments: torch.Tensor, count: int) -> torch.Tensor:
    return torch.zeros(count, dtype=torch.int64).index_add_(0, segments, mask.to(torch.int64))


def _uniform(values: list, what: str) -> torch.Tensor:
    """The one value every parameter holds for a scalar state entry; Fallback when they differ."""
    first = values[0]
    if any(v.shape != first.shape or not torch.equal(v, first) for v in values[1:]):
        raise Fallback(f"{what} differs between the parameters")
    return first


def _joined(states: list[dict], elementwise_keys: set, what: str) -> dict:
    """One state dict for the batch: elementwise entries concatenated (float64, flat), scalar entries shared."""
    keys = set(states[0])
    if any(set(s) != keys for s in states[1:]):
        raise Fallback(f"{what}: state present for some parameters only")
    return {k: (torch.cat([s[k].reshape(-1).double() for s in states]) if k in elementwise_keys
                else _uniform([s[k] for s in states], f"{what} {k!r}")) for k in sorted(keys)}


def _cat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def replay_row(rule, tiles: list, row: int, has_next: bool, next_state_recorded: bool, elementwise_keys: set,
               group: dict, step: int, tol: blocks.Tolerance, where: str, path: str) -> list[blocks.RowResult]:
    """One recorded step of every parameter of a batch (tiles: one blocks.Tile per parameter, holding all its rows,
    the next one included), replayed as one tensor: a RowResult per parameter, as compare_block would fold it."""
    count = len(tiles)
    i = [row - t.start for t in tiles]
    sizes = [t.before[k].numel() for t, k in zip(tiles, i)]
    segments = torch.repeat_interleave(torch.arange(count), torch.tensor(sizes))
    before = _cat(t.before[k] for t, k in zip(tiles, i))
    grad = _cat(t.grad[k] for t, k in zip(tiles, i))
    after = _cat(t.after[k] for t, k in zip(tiles, i))
    state = _joined([t.state_at(row) for t in tiles], elementwise_keys, where)
    next_before = next_state = None
    if has_next:
        next_before = _cat(t.before[k + 1] for t, k in zip(tiles, i))
        if next_state_recorded:
            next_state = _joined([t.state_at(row + 1) for t in tiles], elementwise_keys, where)
    if not all(bool(torch.isfinite(x).all()) for x in (before, grad, after, *state.values())):
        raise Fallback(f"{where}: a non-finite value")
    inputs = blocks.RowInputs(before=before, grad=grad, after=after, state=state, next_before=next_before,
                              next_state=next_state)
    try:
        replayed, replayed_state, _ = blocks.replay_chunks(rule, inputs, elementwise_keys, group, step,
                                                           blocks.CHUNK_ELEMENTS, where, path)
    except NotReplayable as exc:  # the one-by-one path says so for each parameter
        raise Fallback(str(exc)) from None
    # compare_block's arithmetic, element by element, with each parameter's own scale
    size = torch.sub(replayed, before).abs_()
    err = torch.sub(replayed, after).abs_()
    recorded = torch.sub(after, before).abs_()
    if not all(bool(torch.isfinite(x).all()) for x in (size, err, recorded)):
        raise Fallback(f"{where}: a non-finite replayed value")
    scale = _segment_max(size, segments, count)
    bound = after.abs().mul_(tol.ulps * tol.eps).add_((tol.rtol * scale + 1e-30)[segments])
    max_err = _segment_max(err, segments, count)
    ratio = _segment_max(err.div_(bound), segments, count)
    recorded_scale = _segment_max(recorded, segments, count)
    moving = _segment_count(size > 0, segments, count)
    resolved = _segment_count(size > bound, segments, count)
    results = [blocks.RowResult(scale=float(scale[j]), recorded_scale=float(recorded_scale[j]),
                                max_abs_err=float(max_err[j]), err_to_tol=float(ratio[j]), moving=int(moving[j]),
                                resolved=int(resolved[j])) for j in range(count)]
    if next_before is not None:
        differs = _segment_count(next_before != after, segments, count)
        for j in range(count):
            results[j].continuous = not int(differs[j])
    if next_state is not None:
        _compare_state(results, replayed_state, next_state, elementwise_keys, segments, count, tol, where)
    return results


def _compare_state(results: list, replayed_state: dict, next_state: dict, elementwise_keys: set,
                   segments: torch.Tensor, count: int, tol: blocks.Tolerance, where: str) -> None:
    """The replayed state against the next step's recorded state, per parameter, as compare_block does it."""
    for key, value in replayed_state.items():
        if key not in next_state:
            continue
        recorded = next_state[key].reshape(-1).double()
        value = value.reshape(-1)
        if value.numel() != recorded.numel():
            raise Fallback(f"{where}: state {key!r} of another size")  # the one-by-one path names the conflict
        if not (bool(torch.isfinite(value).all()) and bool(torch.isfinite(recorded).all())):
            raise Fallback(f"{where}: a non-finite state value")
        if key in elementwise_keys:
            state_scale = _segment_max(recorded.abs(), segments, count)
            err = torch.sub(value, recorded).abs_()
            bound = recorded.abs().mul_(tol.ulps * tol.eps).add_((tol.rtol * state_scale + 1e-30)[segments])
            ratios = _segment_max(err.div_(bound), segments, count).tolist()
        else:  # a scalar every parameter shares: one comparison holds for all
            ratios = [blocks.compare_parts(value, recorded, blocks.largest(recorded), eps=tol.eps, ulps=tol.ulps,
                                           rtol=tol.rtol)[1]] * count
        for result, found in zip(results, ratios):
            result.state_err_to_tol = found if result.state_err_to_tol is None else max(result.state_err_to_tol,
                                                                                        found)
