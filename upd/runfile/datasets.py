"""New datasets as the schema declares them (name, dtype, rank, chunks, fill), for the writer and for the
statistics table it appends to."""
from __future__ import annotations

import h5py
import numpy as np

from . import schema


def h5py_dtype(decl: schema.Dataset):
    return h5py.string_dtype() if decl.dtype == schema.STRING else np.dtype(decl.dtype)


def create_dataset(group: h5py.Group, decl: schema.Dataset, **layout) -> h5py.Dataset:
    """An empty dataset as the schema declares it, resizable along every axis; layout: the shape and chunks of a
    dataset the writer sizes itself when it creates it."""
    rank = decl.rank
    return group.create_dataset(decl.name, shape=layout.get("shape", (0,) * rank), maxshape=(None,) * rank,
                                dtype=h5py_dtype(decl), chunks=layout.get("chunks", decl.chunks),
                                fillvalue=decl.fill)


def create_declared(group: h5py.Group, layout: schema.Group) -> None:
    """The datasets of a new group whose chunks the schema fixes; the others are created at their first row."""
    for decl in layout.datasets:
        if decl.chunks is not None:
            create_dataset(group, decl)
