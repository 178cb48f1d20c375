"""The schema is what the writer writes: every object of a recorded run (and of the committed sample runs, written
by earlier versions) is declared in upd/runfile/schema.py with the dtype, rank, chunks and fill value found in the
file, and every required declaration is present."""
import math
import os
import re

import h5py
import numpy as np
import pytest
import torch

import upd
from upd.runfile import encoding, schema

from tests.harness.paths import SAMPLE_RUNS
from tests.harness.training import MLP, train_steps


def _pattern(group: schema.Group) -> re.Pattern:
    """The group's path template as a regular expression: {k} an optimizer index, {name} a parameter name."""
    return re.compile(re.escape(group.template).replace(r"\{k\}", r"\d+").replace(r"\{name\}", r"[^/]+") + "$")


def declaration_of(path: str) -> schema.Group | None:
    return next((g for g in schema.GROUPS if _pattern(g).match(path)), None)


def _dtype_problem(decl: schema.Dataset, ds: h5py.Dataset) -> str | None:
    if decl.dtype == schema.STRING:
        ok = h5py.check_string_dtype(ds.dtype) is not None and h5py.check_string_dtype(ds.dtype).encoding == "utf-8"
    elif decl.dtype == schema.STORAGE:
        ok = encoding.numpy_dtype_of(ds.attrs.get(schema.ATTR_TORCH_DTYPE, "?")) == ds.dtype
    else:
        ok = ds.dtype == np.dtype(decl.dtype)
    return None if ok else f"dtype {ds.dtype}, declared {decl.dtype}"


def _layout_problems(decl: schema.Dataset, ds: h5py.Dataset) -> list[str]:
    problems = [p for p in [_dtype_problem(decl, ds)] if p]
    if decl.rank is not None:
        if ds.ndim != decl.rank:
            problems.append(f"rank {ds.ndim}, declared {decl.rank}")
        elif ds.maxshape != (None,) * decl.rank:
            problems.append(f"maxshape {ds.maxshape}, declared resizable along every axis")
    elif ds.maxshape[0] is not None:
        problems.append("not resizable along the row axis")
    if decl.chunks is not None and ds.chunks != decl.chunks:
        problems.append(f"chunks {ds.chunks}, declared {decl.chunks}")
    if decl.fill is not None and not (math.isnan(decl.fill) and np.isnan(ds.fillvalue) or ds.fillvalue == decl.fill):
        problems.append(f"fill value {ds.fillvalue}, declared {decl.fill}")
    return problems


def layout_problems(path: str) -> list[str]:
    """Where the file at path and the schema disagree; empty when every object is declared and as declared."""
    problems = []
    with h5py.File(path, "r") as f:
        objects = {"/": f}
        f.visititems(lambda name, obj: objects.setdefault("/" + name, obj) and None)
        for where, obj in objects.items():
            if isinstance(obj, h5py.Group):
                group = declaration_of(where)
                if group is None:
                    problems.append(f"{where}: group not declared")
                    continue
                declared = {a.name for a in group.attrs}
                problems += [f"{where}: attribute {a!r} not declared" for a in obj.attrs if a not in declared]
                problems += [f"{where}: required attribute {a.name!r} missing" for a in group.attrs
                             if a.required and a.name not in obj.attrs]
                problems += [f"{where}: required dataset {d.name!r} missing" for d in group.datasets
                             if d.required and d.name not in obj]
                continue
            parent, name = where.rsplit("/", 1)
            group = declaration_of(parent or "/")
            decls = [] if group is None else [d for d in group.datasets if d.name in (name, "{key}")]
            if not decls:
                problems.append(f"{where}: dataset not declared")
                continue
            declared = {a.name for a in decls[0].attrs}
            problems += [f"{where}: attribute {a!r} not declared" for a in obj.attrs if a not in declared]
            problems += [f"{where}: {p}" for p in _layout_problems(decls[0], obj)]
    return problems


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A run with everything the writer can create: state, statistics, a second param group, a flight dump."""
    path = str(tmp_path_factory.mktemp("schema") / "full.h5")
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam([{"params": model.fc1.parameters()}], lr=1e-3)
    with upd.record(path, model, opt, stats_every=1, dtype="bfloat16", flight_recorder=4, every=1) as rec:
        train_steps(model, opt, steps=2)
        opt.add_param_group({"params": model.fc2.parameters(), "lr": 1e-2})
        train_steps(model, opt, steps=2)
        rec.dump("a dump, for the schema test")
    return path


def test_a_recorded_run_is_what_the_schema_declares(full_run):
    assert layout_problems(full_run) == []
    with h5py.File(full_run, "r") as f:  # and it holds what the fixture meant it to hold
        assert schema.FLIGHT_DUMPS in f and schema.ATTR_CLOSED_CLEANLY in f.attrs
        assert f[schema.STATS_TABLE.at(schema.VALUES, k=0)].shape[0] == 4
        assert f[schema.RECORD_TABLE.at(schema.LR, k=0)].shape[1] == 2


@pytest.mark.parametrize("path", SAMPLE_RUNS, ids=os.path.basename)
def test_sample_runs_written_by_earlier_versions_are_what_the_schema_declares(path):
    assert layout_problems(path) == []


def test_an_undeclared_or_wrongly_typed_object_is_found(full_run, tmp_path):
    path = str(tmp_path / "changed.h5")
    with open(full_run, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    with h5py.File(path, "r+") as f:
        f[schema.RECORD_TABLE.path(k=0)].create_dataset("loss", data=np.zeros(4))
        wall_time = schema.RECORD_TABLE.at(schema.WALL_TIME, k=0)
        data = f[wall_time][()]
        del f[wall_time]
        f.create_dataset(wall_time, data=data.astype("f4"), maxshape=(None,), chunks=(1024,))
        f.attrs["novel"] = "x"
    assert sorted(layout_problems(path)) == [
        "/: attribute 'novel' not declared",
        "/optimizers/0/records/loss: dataset not declared",
        "/optimizers/0/records/wall_time: dtype float32, declared float64",
    ]


def test_paths_are_found_through_the_schema():
    assert schema.RECORD_TABLE.at(schema.STEP, k=0) == "/optimizers/0/records/step"
    assert schema.PARAMETER.at(schema.STATE_GROUP, k=1, name="fc1.weight") == "/optimizers/1/params/fc1.weight/state"
    assert schema.ROOT.at(schema.FLIGHT_DUMPS) == "/flight_dumps"
    assert schema.ROOT.at(schema.OPTIMIZERS) == "/optimizers"
    with pytest.raises(KeyError, match="declares no member 'loss'"):
        schema.RECORD_TABLE.at("loss", k=0)
    with pytest.raises(KeyError):
        schema.STATS_TABLE.dataset(schema.CLOSURE_LOSSES)
