"""The reading budget: a run file costs memory and time in proportion to the bytes it stores, not to the shapes it
declares (docs/reliability.md, "The reading budget").

Each crafted file below is small on disk and declares far more: tensors whose chunks were never written (with a
compressing filter, and with a checksum filter that compresses nothing), a real deflate bomb (rows of zeros), a
sparse file whose hole holds a 'stored' tensor, record-table columns, record indices and state masks with absurd
declared sizes, and a statistics table declaring 200,000 parameter slots. Every command must refuse each one with
one line that says what the file declares, before it allocates that much; none may mention MemoryError. A valid run
with many parameters must keep its per-parameter cost small: opening it keeps no dataset open and reads none of a
parameter's tensor datasets until they are read.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib

import h5py
import pytest
import torch

import upd
from upd.runfile import schema

from tests.reliability.test_hostile_files import (P, P_PRESENT, P_RECORD, REC_LR, _copy, _peak_rss_mib, _set_meta,
                                                  check_all_commands, check_api, stat)

TENSOR_DATASETS = (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER, "state/exp_avg",
                   "state/exp_avg_sq")
ROWS = 20  # committed records of the Adam sample


def _declare_tensors(f, shape, **create):
    """fc1.weight's tensors redeclared with rows of `shape`, nothing written unless the caller writes it."""
    _set_meta(f, P, shape=list(shape))
    for kind in TENSOR_DATASETS:
        attrs = dict(f[f"{P}/{kind}"].attrs)
        del f[f"{P}/{kind}"]
        ds = f.create_dataset(f"{P}/{kind}", shape=(ROWS, *shape), dtype="f4", **create)
        for k, v in attrs.items():
            ds.attrs[k] = v


def _refused_everywhere(path, words=("declares",)):
    before = _peak_rss_mib()
    check_all_commands(path, words=words, measure_memory=True)
    assert check_api(path, words=words) is False
    assert _peak_rss_mib() - before < 512


@pytest.mark.parametrize("filters", [{"compression": "gzip"}, {"fletcher32": True}], ids=["gzip", "fletcher32"])
def test_declared_but_unwritten_tensors_are_refused(tmp_path, filters):
    """1 GiB rows declared, no chunk written: the old allowance (4096x the file for any filter) let every command
    allocate them and end in a MemoryError line. Chunks never written store nothing: refused, saying so."""
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        _declare_tensors(f, (16384, 16384), chunks=(1, 16384, 16384), **filters)
    assert os.path.getsize(path) < 2 << 20
    _refused_everywhere(path, words=("fc1.weight", "declares shape (20, 16384, 16384)", "1.0 GiB", "stores 0 bytes"))


@pytest.mark.slow
def test_a_real_deflate_bomb_is_refused(tmp_path):
    """Rows of zeros really written, deflated about 1000:1 (64 MiB rows in a 1.4 MB file): more than the budget
    (MAX_READ_RATIO times what the dataset stores), so refused before a row is inflated."""
    path = _copy("adam.h5", str(tmp_path))
    shape = (4096, 4096)
    deflated = zlib.compress(bytes(4 * 4096 * 4096), 9)
    with h5py.File(path, "r+") as f:
        _declare_tensors(f, shape, chunks=(1, *shape), compression="gzip")
        for kind in TENSOR_DATASETS:
            for row in range(ROWS):
                f[f"{P}/{kind}"].id.write_direct_chunk((row, 0, 0), deflated)
    assert os.path.getsize(path) < 8 << 20
    with h5py.File(path, "r") as f:  # the bomb is real: HDF5 inflates a row to 64 MiB of zeros
        assert not f[f"{P}/{schema.KIND_GRAD}"][3, :8, :8].any()
    _refused_everywhere(path, words=("fc1.weight", "compressed"))


def test_a_sparse_file_counts_its_bytes_on_disk(tmp_path):
    """A contiguous tensor dataset whose storage lies in a hole: 20 GiB apparent size, well under 1 MB on disk. The
    old bound used the apparent size (st_size) and read a 1 GiB row; the bytes on disk (st_blocks) bound it now."""
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        _declare_tensors(f, (16384, 16384))  # contiguous: HDF5 allocates all of it at the first write
        for kind in TENSOR_DATASETS:
            f[f"{P}/{kind}"][ROWS - 1, -1, -1] = 1.0
    st = os.stat(path)
    if st.st_blocks * 512 > 64 << 20:
        pytest.skip("this filesystem does not keep holes in sparse files")
    assert st.st_size > 20 << 30
    _refused_everywhere(path, words=("fc1.weight", "declares shape", "on disk"))


def _unwritten(f, name, shape, chunks):
    """Dataset `name` redeclared with `shape`, a checksum filter and only its first chunk written (what it held)."""
    old = f[name]
    head = old[tuple(slice(0, min(a, b)) for a, b in zip(old.shape, shape))]
    attrs = dict(old.attrs)
    del f[name]
    ds = f.create_dataset(name, shape=shape, maxshape=(None,) * len(shape), dtype=old.dtype, chunks=chunks,
                          fletcher32=True)
    ds[tuple(slice(0, n) for n in head.shape)] = head
    for k, v in attrs.items():
        ds.attrs[k] = v


EVERYWHERE = {"info": {2}, "analyze": {2}, "verify": {2}}
TABLES = [
    ("records/lr with 10M group columns", lambda f: _unwritten(f, REC_LR, (ROWS, 10_000_000), (256, 8)), EVERYWHERE),
    ("record index of 200M rows", lambda f: _unwritten(f, P_RECORD, (200_000_000,), (1024,)), EVERYWHERE),
    # `info` reads no state: the mask is checked with the parameter's other datasets, when they are first read
    ("state_present of 2e9 columns", lambda f: _unwritten(f, P_PRESENT, (ROWS, 2_000_000_000), (256, 8)),
     {"info": {0}, "analyze": {2}, "verify": {2}}),
]


@pytest.mark.parametrize("what, mutation, allowed", TABLES, ids=[t[0] for t in TABLES])
def test_tables_declaring_more_than_they_store_are_refused(tmp_path, what, mutation, allowed):
    """A checksum filter (fletcher32) compresses nothing: the old allowance for 'filtered' data (4096x the file)
    let `info` allocate 1.6 GB for records/lr and verify read a 2 GB state mask row by row."""
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        mutation(f)
    assert os.path.getsize(path) < 2 << 20
    before = _peak_rss_mib()
    check_all_commands(path, allowed, words=("declares",), measure_memory=True)
    assert check_api(path, words=("declares",)) is False
    assert _peak_rss_mib() - before < 512


def test_statistics_table_declaring_200000_parameter_slots_is_refused(tmp_path, stats_run):
    """200,000 named slots in a 2 MB statistics-only run, their chunks never written: `analyze` took 235 s and
    2.5 GB building a table of NaNs. The slots store nothing: refused when the file is opened."""
    path = str(tmp_path / "slots.h5")
    shutil.copy(stats_run, path)
    values = stat(schema.VALUES)
    with h5py.File(path, "r+") as f:
        st = f[schema.STATS_TABLE.path(k=0)]
        names = json.loads(st.attrs[schema.STATS_PARAMS])
        st.attrs[schema.STATS_PARAMS] = json.dumps(names + [f"ghost{i}" for i in range(200_000 - len(names))])
        f[values].resize(200_000, axis=1)
    assert os.path.getsize(path) < 4 << 20
    _refused_everywhere(path, words=("statistics table", "declares shape"))


# -- the per-parameter cost of a valid run ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def many_params_run(tmp_path_factory):
    """A real run of 300 one-element parameters (Adam, 3 steps): the shape of the 5,000-parameter benchmark."""
    path = str(tmp_path_factory.mktemp("many") / "many.h5")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(1)) for _ in range(300)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(path, model, opt, every=1):
        for _ in range(3):
            opt.zero_grad()
            sum((p * p).sum() for p in model.p).backward()
            opt.step()
    return path


def _open_datasets(run) -> int:
    return h5py.h5f.get_obj_count(run._file.id, h5py.h5f.OBJ_DATASET)


@pytest.mark.slow
def test_opening_a_run_keeps_no_dataset_open_and_reads_no_tensor_dataset(many_params_run, monkeypatch):
    """`upd info` on 5,000 one-element parameters took 18-20 s and 2.8 GB: each of the 40,000 datasets was opened
    and checked at open, and kept open (HDF5 holds its metadata) by a cache keyed by dataset. Now opening opens per
    parameter its record index alone, describe() the 'param' dataset for its dtype, and neither keeps them open."""
    opened = []
    real_open = h5py.h5o.open

    def counting_open(loc, name, *args, **kwargs):
        opened.append(name.decode() if isinstance(name, bytes) else name)
        return real_open(loc, name, *args, **kwargs)

    monkeypatch.setattr(h5py.h5o, "open", counting_open)
    with upd.open_run(many_params_run) as run:
        assert len(run.param_records if hasattr(run, "param_records") else run.optimizers[0].param_records) == 300
        at_open = list(opened)
        run.describe()
        in_describe = opened[len(at_open):]
        held = _open_datasets(run)
        p = run.optimizers[0].param_records["p.7"]
        assert p.kinds == ["param", "grad", "param_after"] and p.state_keys == ["step", "exp_avg", "exp_avg_sq"]
        assert p.read("grad").shape == (3, 1)  # the first read checks the parameter's datasets, then reads
    tensor_names = {"param", "grad", "param_after", "exp_avg", "exp_avg_sq", "state_present"}
    assert not tensor_names & set(at_open), sorted(set(at_open))
    assert len(at_open) < 4 * 300, len(at_open)  # its group, its record index, its state group; a few shared
    assert set(in_describe) <= {"param"} and len(in_describe) <= 300, sorted(set(in_describe))
    assert held < 20, held


@pytest.mark.slow
def test_a_parameter_whose_gradient_is_missing_at_most_steps_still_reads(tmp_path):
    """Budgets are per parameter and per file, never against the whole run's records: a parameter with a gradient
    (so a row) at one step of 80, next to one with 80 rows, reads and verifies."""
    path = str(tmp_path / "rare grad.h5")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(64, 64))
    model.b = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, every=1):
        for step in range(80):
            opt.zero_grad()
            loss = (model.a ** 2).sum() + ((model.b ** 2).sum() if step == 79 else 0)
            loss.backward()
            opt.step()
    codes = check_all_commands(path, {"info": {0}, "analyze": {0}, "verify": {0}})
    assert codes == {"info": 0, "analyze": 0, "verify": 0}


@pytest.mark.slow
def test_the_budget_is_the_users_to_raise(tmp_path, monkeypatch):
    """UPD_MAX_READ_RATIO (the user's, never the file's) reads a run whose tensors really are that uniform."""
    path = _copy("adam.h5", str(tmp_path))
    deflated = zlib.compress(bytes(4 * 256 * 256), 9)
    with h5py.File(path, "r+") as f:
        _declare_tensors(f, (256, 256), chunks=(1, 256, 256), compression="gzip")
        for kind in TENSOR_DATASETS:
            for row in range(ROWS):
                f[f"{P}/{kind}"].id.write_direct_chunk((row, 0, 0), deflated)
    check_all_commands(path, words=("fc1.weight", "compressed"))
    monkeypatch.setenv("UPD_MAX_READ_RATIO", "5000")
    codes = check_all_commands(path, {"info": {0}, "analyze": {0}, "verify": {0, 1, 3}})
    assert codes["analyze"] == 0
    with upd.open_run(path) as run:
        assert not run.param("fc1.weight").read("grad", 3).any()
