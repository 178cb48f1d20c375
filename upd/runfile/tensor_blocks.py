"""A stored tensor read in blocks: each part a contiguous run of elements of one row, which HDF5 reads as one
hyperslab. Verify replays a parameter a block at a time (replay/blocks.py) and the ratio table sums it a block at a
time (ratio_table.py), so that memory is bounded by a block, never by a parameter."""
from __future__ import annotations

import itertools
import math

# Elements of one row read and replayed at once: float64 working copies of a block take 8 bytes per element each.
BLOCK_ELEMENTS = 1 << 21


def element_blocks(shape: tuple, limit: int, whole_rows: bool = False) -> list[tuple]:
    """Index tuples over a tensor of `shape`, in order, each selecting a contiguous run of at most `limit` elements
    (or one row along dimension 0 when a row is larger and `whole_rows`, one element at least)."""
    numel = math.prod(shape)
    if not shape or numel == 0 or numel <= limit:
        return [()]
    k = 0
    while not whole_rows and k < len(shape) - 1 and math.prod(shape[k + 1:]) > limit:
        k += 1
    inner = math.prod(shape[k + 1:])
    size = max(1, limit // inner)
    return [(*outer, slice(lo, min(lo + size, shape[k])))
            for outer in itertools.product(*(range(d) for d in shape[:k]))
            for lo in range(0, shape[k], size)]


def block_shape(shape: tuple, index: tuple) -> tuple:
    """The shape of tensor[index] for an index from element_blocks."""
    out = []
    for i, d in enumerate(shape):
        if i < len(index):
            if isinstance(index[i], slice):
                out.append(len(range(*index[i].indices(d))))
        else:
            out.append(d)
    return tuple(out)
