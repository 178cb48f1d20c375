"""FSDP2 (torch.distributed.fsdp.fully_shard) recorded on every rank of a job, each rank file read on its own.

The job is real: 3 gloo processes train a 5-7-2 network whose layers shard unevenly (7 rows: 3+3+1) and leave one
rank without any part of the last layer (2 rows: 1+1+0). A job of 2 processes, all of whose shards hold rows, would
add no layout this one lacks (test_fsdp_job.py and test_tensorboard_job.py run FSDP2 on 2 processes). Each rank
trains on its slice of a global batch; FSDP2 averages the gradients over the ranks, so the whole job computes what a
single process computes on the whole batch with the mean loss. That single-process run, recorded in this process,
is the reference: every stored shard equals its slice of the reference's tensors to float32 rounding (the
reduce-scatter sums in another order).
"""
from __future__ import annotations

import math
import os
import shutil

import h5py
import pytest
import torch
from torch import nn

import upd
from tests.harness.distributed import job_path, record_references, run_job
from upd.runfile import encoding, schema
from upd.runfile.ranks import rank_path
from upd.runfile.stats_table import stats_param_meta

GLOBAL_BATCH = 6  # divisible by 2 and 3: every rank gets an equal slice
STEPS = 3
NAN_STEP = STEPS - 1  # the flight-recorder job puts a NaN into one rank's gradient shard at its last step
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}
MODES = {
    "full": {"every": 1, "stats_every": 1},  # full records, statistics from the CPU copies
    "stats": {"every": None, "stats_every": 1, "full_stats_every": 1},  # statistics only, on the device, full set
}
FLIGHT = ("adamw", "flight")
JOBS = [(opt, mode) for opt in OPTIMIZERS for mode in MODES] + [FLIGHT]
# float32 rounding of a few steps (the gradients are averaged over ranks in another order than one process sums)
RTOL, ATOL = 1e-5, 1e-6


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def train(model, optimizer, rows: slice, before_step=None) -> None:
    for step in range(STEPS):
        x, y = global_batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if before_step is not None:
            before_step(step)
        optimizer.step()


def fsdp_worker(rank: int, world_size: int, folder: str) -> dict:
    """Train each job configuration under FSDP2 and record it; returns the model's parameter names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    names = None
    for opt_name, mode in JOBS:
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        names = [n for n, _ in model.named_parameters()]
        optimizer = OPTIMIZERS[opt_name](model.parameters())
        options = MODES.get(mode, {"every": None, "flight_recorder": STEPS})

        def poison(step, model=model):  # NaN in rank 1's part of the first layer's gradient, at the last step
            if mode == "flight" and rank == 1 and step == NAN_STEP:
                model[0].weight.grad.to_local()[0, 0] = float("nan")

        with upd.record(job_path(folder, opt_name, mode), model, optimizer, strict=True, **{"every": 1, **options}):
            train(model, optimizer, rows, before_step=poison)
    return {"names": names}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """The single-process run of each optimizer on the whole batch, recorded in full: {optimizer: path}."""
    return record_references(tmp_path_factory.mktemp("reference"), OPTIMIZERS, make_model, train)


@pytest.fixture(scope="module", params=[3], ids=["3-ranks"])
def fsdp_job(request, tmp_path_factory) -> tuple[int, str, list]:
    """(world size, folder of the jobs' files, the FSDP2 model's parameter names)."""
    world = request.param
    folder = str(tmp_path_factory.mktemp(f"fsdp{world}"))
    results = run_job(fsdp_worker, world, folder)
    return world, folder, results[0]["names"]


def expected_rows(global_rows: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, rows) of a rank's Shard(0) part: torch.chunk's split (ceil(n / world) rows per rank, the last ranks
    get fewer or none)."""
    per = math.ceil(global_rows / world)
    start = min(rank * per, global_rows)
    return start, min(per, global_rows - start)


def shard_of(tensor: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    return tensor[offset:offset + rows]


def stats_of(t: torch.Tensor) -> dict:
    t = t.double().reshape(-1)
    if t.numel() == 0:
        return {}
    return {"mean": float(t.mean()), "norm": float(t.norm()), "absmax": float(t.abs().max()),
            **({"std": float(t.std())} if t.numel() > 1 else {})}


@pytest.mark.slow
def test_each_rank_file_holds_its_shards_and_verifies(fsdp_job, references):
    """Every rank file, opened alone: the parameter names are the model's plain names, the metadata places each
    shard in the whole tensor, every stored tensor (parameter, gradient, parameter after, optimizer state) equals
    its slice of the single-process run, the statistics are those of the shard, and verify replays it (exit 0)."""
    world, folder, names = fsdp_job
    reference_model = make_model()
    assert names == [n for n, _ in reference_model.named_parameters()]  # FSDP2 names are the plain names
    global_shapes = {n: list(p.shape) for n, p in reference_model.named_parameters()}
    empty_shards = 0
    for opt_name in OPTIMIZERS:
        with upd.open_run(references[opt_name]) as ref:
            for mode in MODES:
                for rank in range(world):
                    path = rank_path(job_path(folder, opt_name, mode), rank, world)
                    with upd.open_run(path) as run:
                        opt = run.optimizers[0]
                        if mode == "full":
                            assert list(opt.param_records) == names
                        table_meta = stats_param_meta(opt)
                        assert sorted(table_meta) == sorted(names)
                        for name in names:
                            offset, rows = expected_rows(global_shapes[name][0], world, rank)
                            shape = [rows, *global_shapes[name][1:]]
                            meta = table_meta[name]
                            assert meta["shape"] == shape and meta["global_shape"] == global_shapes[name]
                            assert meta["offset"] == [offset] + [0] * (len(shape) - 1)
                            assert meta["placements"] == ["Shard(dim=0)"] and meta["mesh_shape"] == [world]
                            empty_shards += rows == 0
                            if mode == "full":
                                assert opt.param_records[name].meta == meta
                                _assert_tensors_are_slices(run.param(name), ref.param(name), offset, rows)
                            _assert_stats_of_slices(run.stats(), ref.param(name), name, offset, rows)
                        if mode == "full":
                            report = upd.verify(path)
                            assert report.exit_code == 0, report.summary()
                            skipped = report.checks[report.checks["status"] == "skipped"]
                            assert set(skipped["note"]) <= {"this rank holds no part of this parameter (an empty "
                                                            "shard)"}
    assert empty_shards == (0 if world == 2 else 2 * 2 * 2)  # 3 ranks: rank 2 holds none of 2.weight, 2.bias


def _assert_tensors_are_slices(shard, whole, offset: int, rows: int) -> None:
    assert shard.num_rows == whole.num_rows == STEPS
    assert shard.state_keys == whole.state_keys
    for row in range(STEPS):
        for kind in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER):
            torch.testing.assert_close(shard.read(kind, row), shard_of(whole.read(kind, row), offset, rows),
                                       rtol=RTOL, atol=ATOL)
        state, whole_state = shard.state_at(row), whole.state_at(row)
        assert state.keys() == whole_state.keys()
        for key, value in state.items():
            # the step counter stays a plain tensor, the same on every rank; the other state is sharded
            expected = whole_state[key] if key == "step" else shard_of(whole_state[key], offset, rows)
            torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL)


def _assert_stats_of_slices(stats, whole, name: str, offset: int, rows: int) -> None:
    """The statistics table holds the statistics of the rank's shard (the reader combines shards)."""
    mine = stats[stats["param"] == name].set_index("step")
    if rows == 0:  # an empty shard's statistics are NaN (count 0: it adds nothing when shards are combined)
        for kind in ("param", "grad", "update"):
            assert mine[[f"{kind}_{stat}" for stat in ("mean", "std", "norm", "absmax")]].isna().all().all()
        return
    assert list(mine.index) == list(range(STEPS))
    for row in range(STEPS):
        before = shard_of(whole.read(schema.KIND_PARAM, row), offset, rows)
        kinds = {"param": before, "grad": shard_of(whole.read(schema.KIND_GRAD, row), offset, rows),
                 "update": shard_of(whole.read(schema.KIND_PARAM_AFTER, row), offset, rows) - before}
        for key, value in whole.state_at(row).items():
            if key != "step":
                kinds[f"state.{key}"] = shard_of(value, offset, rows)
        for kind, tensor in kinds.items():
            for stat, value in stats_of(tensor).items():
                assert mine.loc[row, f"{kind}_{stat}"] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, row, kind)


@pytest.mark.slow
def test_a_corrupted_shard_fails_verify_of_its_rank_only(fsdp_job, tmp_path):
    world, folder, _ = fsdp_job
    corrupted_rank = world - 1  # on 3 ranks the one with an empty shard: its other shards still verify
    paths = {}
    for rank in range(world):
        paths[rank] = str(tmp_path / os.path.basename(rank_path(job_path(folder, "sgd", "full"), rank, world)))
        shutil.copy(rank_path(job_path(folder, "sgd", "full"), rank, world), paths[rank])
    with h5py.File(paths[corrupted_rank], "r+") as f:
        after = f[f"{schema.OPTIMIZERS}/0/{schema.PARAMS}/0.weight/{schema.KIND_PARAM_AFTER}"]
        values = after[1]
        values[0, 0] += 0.01
        after[1] = values
    for rank, path in paths.items():
        report = upd.verify(path)
        if rank != corrupted_rank:
            assert report.exit_code == 0, report.summary()
            continue
        assert report.exit_code == 1
        bad = report.checks[report.checks["status"] == "mismatch"]
        assert list(zip(bad["param"], bad["step"])) == [("0.weight", 1)]


@pytest.mark.slow
def test_the_flight_recorder_dumps_on_the_rank_whose_shard_turned_nan(fsdp_job):
    """A trigger is decided on each rank's own shard: the rank whose gradient shard holds the NaN dumps its last
    steps; the others, whose shards are finite at that step, write nothing."""
    world, folder, _ = fsdp_job
    for rank in range(world):
        with upd.open_run(rank_path(job_path(folder, *FLIGHT), rank, world)) as run:
            dumps = run.dumps()
            if rank != 1:
                assert dumps.empty and run.optimizers[0].num_records == 0
                continue
            assert list(dumps["reason"]) == [f"non-finite gradient at step {NAN_STEP}"]
            assert list(run.optimizers[0].steps) == list(range(STEPS))
            grad = run.param("0.weight").read(schema.KIND_GRAD, NAN_STEP)
            assert grad.shape == (expected_rows(7, world, 1)[1], 5) and torch.isnan(grad[0, 0])


# -- in one process: a DTensor on a one-process mesh, and rules that need the whole tensor -------------------------
@pytest.mark.parametrize("placement", ["Shard(dim=0)", "Replicate()"])
def test_a_dtensor_parameter_is_recorded_as_its_local_part(tmp_path, cpu_mesh, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    place = Shard(0) if placement.startswith("Shard") else Replicate()
    weight = nn.Parameter(distribute_tensor(torch.randn(4, 6), cpu_mesh, [place]))
    opt = torch.optim.Adam([weight], lr=0.1)
    path = str(tmp_path / "run.h5")
    with upd.record(path, None, opt, stats_every=1, strict=True, every=1):
        for step in range(3):
            weight.grad = distribute_tensor(torch.full((4, 6), float(step + 1)), cpu_mesh, [place])
            opt.step()
    with upd.open_run(path) as run:
        p = run.param("group0.param0")
        assert p.meta == {**stats_param_meta(run.optimizers[0])["group0.param0"]} == {
            "name": "group0.param0", "group": 0, "index_in_group": 0, "shape": [4, 6], "dtype": "float32",
            "global_shape": [4, 6], "offset": [0, 0], "placements": [placement], "mesh_shape": [1],
            "part_layout": "box"}
        torch.testing.assert_close(p.read(schema.KIND_PARAM_AFTER, 2), weight.to_local().detach())
        assert run.stats()["grad_mean"].tolist() == [1.0, 2.0, 3.0]
    assert upd.verify(path).exit_code == 0


def test_a_partial_gradient_stops_recording_with_one_warning(tmp_path, cpu_mesh):
    """A Partial gradient is a summand on each rank, no slice of the whole: recording stops (as for every DTensor
    before distributed support), training goes on, and strict= raises."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    weight = nn.Parameter(distribute_tensor(torch.randn(4, 6), cpu_mesh, [Shard(0)]))
    opt = torch.optim.SGD([weight], lr=0.1)
    with pytest.warns(upd.RecorderWarning, match="gradient of group0.param0 is a DTensor laid out unlike"):
        with upd.record(str(tmp_path / "run.h5"), None, opt, every=1) as rec:
            weight.grad = DTensor.from_local(torch.ones(4, 6), cpu_mesh, [Partial()])
            opt.step()
    assert isinstance(rec.error, TypeError)
    with pytest.raises(TypeError, match="Partial"):
        with upd.record(str(tmp_path / "strict.h5"), None, opt, strict=True, every=1):
            weight.grad = DTensor.from_local(torch.ones(4, 6), cpu_mesh, [Partial()])
            opt.step()


def _as_shard_of_a_larger_tensor(path: str) -> None:
    """Make every parameter of a single-process run look like rank 0's shard of a tensor twice as long."""
    with h5py.File(path, "r+") as f:
        for grp in f[f"{schema.OPTIMIZERS}/0/{schema.PARAMS}"].values():
            meta = encoding.from_json(grp.attrs[schema.ATTR_META])
            meta.update(global_shape=[2 * meta["shape"][0], *meta["shape"][1:]], offset=[0] * len(meta["shape"]),
                        placements=["Shard(dim=0)"], mesh_shape=[2])
            grp.attrs[schema.ATTR_META] = encoding.to_json(meta)
        # the parameter index repeats every group's metadata: without it the groups are read (else: refused)
        del f[f"{schema.OPTIMIZERS}/0/{schema.PARAMS}"].attrs[schema.PARAM_INDEX]


@pytest.mark.parametrize("optimizer, whole", [(torch.optim.Adafactor, True), (torch.optim.Muon, True),
                                              (torch.optim.AdamW, False), (torch.optim.SGD, False)],
                         ids=["Adafactor", "Muon", "AdamW", "SGD"])
def test_rules_that_need_the_whole_tensor_skip_a_shard(tmp_path, optimizer, whole):
    """The same records verify while whole; once their metadata says they are shards, elementwise rules still
    verify them and whole-tensor rules say why they cannot (no false mismatch)."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 4))
    opt = optimizer([weight], lr=0.01)
    path = str(tmp_path / "run.h5")
    with upd.record(path, None, opt, strict=True, every=1):
        for _ in range(3):
            weight.grad = torch.randn(6, 4)
            opt.step()
    assert upd.verify(path).exit_code == 0
    _as_shard_of_a_larger_tensor(path)
    report = upd.verify(path)
    if not whole:
        assert report.exit_code == 0
        return
    assert report.exit_code == 3 and report.skipped == 3
    assert set(report.checks["note"]) == {f"torch.optim.{optimizer.__name__} needs the whole tensor; this "
                                          "parameter is a shard"}
