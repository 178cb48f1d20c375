"""Reading a distributed job (upd.runfile.job) without starting one: rank files built from real single-process runs.

- sharded: a real run split into 3 ranks' shards as FSDP2 would store them (torch.chunk, uneven, one rank holding
  no part of the last layer, one parameter sharded along dim 1), written with the run writer and the spec's
  metadata: the job must read back exactly the run it was cut from;
- partition: two single-process runs of one model, each recording half of the parameters (include=), as ZeRO ranks;
- replicated: one run recorded twice, as DDP with ranks="all".
Real multi-process jobs are in tests/distributed/test_fsdp_job.py.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import upd
from tests.harness.training import MLP, record_run, train_steps
from upd.runfile.shard_stats import scalar_rows, split_column
from tests.harness.shard_stats import combine_shard_frames, combine_tensor_stats
from upd.cli.main import main
from upd.recorder.device_stats import STATS, StepStatistics
from upd.replay.engine import CHECK_COLUMNS, EXIT_MATCH, EXIT_MISMATCH, EXIT_UNUSABLE
from upd.runfile import schema
from upd.runfile.job import (PARTITION, REPLICATED, SHARDED, Job, param_layout, positions, step_ranges,
                             tiling_problem)
from upd.runfile.ranks import rank_path
from upd.runfile.record import ParamSnapshot, Record, ShardLayout, param_meta
from upd.runfile.writer import RunWriter

WORLD = 3
# How the sharded job cuts each parameter of the harness MLP (fc1 16->12, fc2 12->4): the dimension, torch.chunk
# style. fc1.weight along its 16 columns: 6 + 6 + 4; fc2 along its 4 rows: 2 + 2 + 0 (rank 2 holds none of it).
SHARD_DIM = {"fc1.weight": 1, "fc1.bias": 0, "fc2.weight": 0, "fc2.bias": 0}


def chunk_box(shape: tuple, dim: int, rank: int, world: int) -> tuple[tuple, tuple]:
    """(offset, shape) of rank's part under torch.chunk along dim (FSDP2's Shard(dim))."""
    size = shape[dim]
    per = -(-size // world)
    start = min(rank * per, size)
    stop = min(start + per, size)
    offset = tuple(start if d == dim else 0 for d in range(len(shape)))
    local = tuple(stop - start if d == dim else s for d, s in enumerate(shape))
    return offset, local


def part(t: torch.Tensor, box) -> torch.Tensor:
    offset, local = box
    return t[tuple(slice(o, o + s) for o, s in zip(offset, local))].clone()


def write_sharded_job(single: str, job: str, world: int = WORLD) -> None:
    """Every rank's file of `single` cut into shards (full records, and statistics of each shard at every step)."""
    with upd.open_run(single) as run:
        for rank in range(world):
            meta = dict(run.meta, distributed={"rank": rank, "world_size": world, "recording_ranks": "all",
                                               "parallelism": "fsdp", "job_path": job})
            writer = RunWriter(rank_path(job, rank, world), meta, overwrite=True, storage_dtype="keep",
                               compression=None)
            for opt in run.optimizers:
                writer.add_optimizer(opt.index, opt.meta)
                for record in range(opt.num_records):
                    snaps, keys, tensors = [], [], []
                    for p in opt.param_records.values():
                        row = int(np.nonzero(p.records == record)[0][0])
                        dim = SHARD_DIM[p.name]
                        box = chunk_box(p.shape, dim, rank, world)
                        layout = ShardLayout(global_shape=list(p.shape), offset=list(box[0]),
                                             placements=[f"Shard(dim={dim})"], mesh_shape=[world])
                        before, grad, after = (part(p.read(k, row), box) for k in ("param", "grad", "param_after"))
                        state = {k: part(v, box) if tuple(v.shape) == p.shape else v.reshape(p.state_shape(k))
                                 for k, v in p.state_at(row).items()}
                        snaps.append(ParamSnapshot(p.name, p.param_group, p.meta["index_in_group"], param=before,
                                                   grad=grad, state=state, param_after=after, shard=layout))
                        for kind, t in [("param", before), ("grad", grad), ("update", after - before)] + \
                                [(f"state.{k}", v) for k, v in state.items()]:
                            keys.append((p.name, kind))
                            tensors.append(t)
                    stats = StepStatistics(("grad",))
                    stats.launch(keys, tensors)
                    writer.write(Record(optimizer=opt.index, step=int(opt.steps[record]),
                                        backward_pass=int(opt.backward_passes[record]),
                                        wall_time=float(opt.wall_times[record]), hparams=opt.hparams(record),
                                        params=snaps, closure_losses=opt.closure_losses(record),
                                        stats=stats.read(), stats_meta={s.name: param_meta(s, s.param) for s in snaps}))
            writer.close()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(the single-process AdamW run, the path of the 3-rank job cut from it)."""
    folder = tmp_path_factory.mktemp("sharded")
    single = record_run(str(folder / "single.h5"), lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                        steps=4, stats_every=1)
    job = str(folder / "job.h5")
    write_sharded_job(single, job)
    return single, job


def copy_job(job: str, folder, world: int = WORLD) -> str:
    target = os.path.join(str(folder), os.path.basename(job))
    for rank in range(world):
        shutil.copy(rank_path(job, rank, world), rank_path(target, rank, world))
    return target


def run_cli(*args):
    return CliRunner().invoke(main, list(args))


# -- the combining math, against torch -------------------------------------------------------------------------------
def torch_stats(t: torch.Tensor) -> dict:
    t = t.double().flatten()
    n = t.numel()
    if n == 0:
        return {s: math.nan for s in STATS}
    return {"mean": float(t.mean()), "std": float(t.std()) if n > 1 else math.nan, "norm": float(t.norm()),
            "absmax": float(t.abs().max()), "zero_frac": float((t == 0).double().mean()),
            "nonfinite": float((~torch.isfinite(t)).sum())}


@pytest.mark.parametrize("sizes", [(7, 5, 0), (1, 9, 4), (13,), (2, 1, 1, 0, 6)])
def test_combined_statistics_equal_the_whole_tensors(sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    rows = 3
    whole = [torch.randn(sum(sizes), generator=g) * (r + 1) + r for r in range(rows)]
    for w in whole:
        w[::4] = 0.0
    stats = {s: np.array([[torch_stats(w[sum(sizes[:i]):sum(sizes[:i + 1])])[s] for w in whole]
                          for i in range(len(sizes))]) for s in STATS}
    combined = combine_tensor_stats(np.array(sizes), stats)
    for s in STATS:
        expected = np.array([torch_stats(w)[s] for w in whole])
        np.testing.assert_allclose(combined[s], expected, rtol=1e-12, atol=1e-12, err_msg=s)


def test_combining_float32_statistics_keeps_the_spread_of_a_tensor_near_one():
    """|mean| >> std (a norm layer's scale): the parallel-variance form keeps the std that sum-of-squares loses."""
    g = torch.Generator().manual_seed(0)
    whole = 1.0 + 1e-4 * torch.randn(3000, generator=g, dtype=torch.float64)
    shards = whole.split([1000, 1200, 800])
    stats = {s: np.array([[np.float32(torch_stats(t)[s])] for t in shards]) for s in STATS}
    n = np.array([t.numel() for t in shards])
    combined = combine_tensor_stats(n, stats)
    assert combined["std"][0] == pytest.approx(float(whole.std()), rel=1e-3)
    # what the textbook form would give from the same float32 numbers: nothing of the spread survives
    sum_, sumsq = (stats["mean"][:, 0] * n).sum(), (stats["norm"][:, 0].astype(np.float64) ** 2).sum()
    textbook = math.sqrt(max(sumsq - sum_ ** 2 / n.sum(), 0) / (n.sum() - 1))
    assert abs(textbook - float(whole.std())) > 10 * abs(combined["std"][0] - float(whole.std()))


def test_a_shard_with_a_nan_makes_the_combined_statistics_nan_and_counts_add_up():
    shards = [torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([2.0, float("inf")])]
    stats = {s: np.array([[torch_stats(t)[s]] for t in shards]) for s in STATS}
    stats["mean"][0, 0] = stats["std"][0, 0] = math.nan
    combined = combine_tensor_stats(np.array([3, 2]), stats)
    assert combined["nonfinite"][0] == 2 and math.isnan(combined["std"][0]) and math.isnan(combined["mean"][0])


def test_scalar_state_is_told_from_a_shard_by_its_missing_spread():
    counts = np.array([4, 4, 0])
    step = {"std": np.array([[np.nan, np.nan], [np.nan, np.nan], [np.nan, np.nan]]),
            "nonfinite": np.zeros((3, 2))}
    shard = {"std": np.array([[0.5, np.nan], [0.2, 0.1], [np.nan, np.nan]]), "nonfinite": np.array([[0, 1], [0, 0],
                                                                                                      [0, 0]])}
    assert scalar_rows(counts, step).tolist() == [True, True]
    assert scalar_rows(counts, shard).tolist() == [False, False]  # a NaN std from a NaN value is not a scalar
    assert split_column("state.exp_avg_sq_zero_frac") == ("state.exp_avg_sq", "zero_frac")
    assert split_column("update_to_data") is None


def test_combined_frames_keep_the_steps_every_shard_has():
    a = pd.DataFrame({"step": [0, 1, 2], "lr": 0.1, "param_mean": [1.0, 2.0, 3.0], "param_std": [1.0, 1.0, 1.0],
                      "update_mean": 0.0, "update_std": [0.1, 0.1, 0.1], "update_to_data": [9.0, 9.0, 9.0]})
    b = a.iloc[1:].assign(param_mean=[4.0, 5.0])
    out = combine_shard_frames([(2, a), (2, b)])
    assert out["step"].tolist() == [1, 2]
    assert out["param_mean"].tolist() == [3.0, 4.0]
    assert np.allclose(out["update_to_data"], np.log10(out["update_std"] / out["param_std"]))


# -- layouts ----------------------------------------------------------------------------------------------------------
def test_tiling_finds_gaps_overlaps_and_overhangs():
    shape = (7, 4)
    good = [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((6, 0), (1, 4)), ((7, 0), (0, 4))]
    assert tiling_problem(shape, good) is None
    assert tiling_problem(shape, good + [((0, 0), (3, 4))]) is None  # a replicated shard (HSDP) counts once
    assert "hold 24 of its 28" in tiling_problem(shape, good[:2])
    assert "overlap" in tiling_problem(shape, good + [((2, 0), (2, 4))])
    assert "past" in tiling_problem(shape, [((5, 0), (3, 4))])
    assert "no rank holds" in tiling_problem(shape, [((7, 0), (0, 4))])


def test_layouts_follow_the_metadata():
    meta = lambda shape, **kw: {"shape": list(shape), **kw}  # noqa: E731
    sharded = param_layout({0: meta((2, 4), global_shape=[3, 4], offset=[0, 0]),
                            1: meta((1, 4), global_shape=[3, 4], offset=[2, 0])})
    assert (sharded.layout, sharded.shape, sharded.readers) == (SHARDED, (3, 4), (0, 1))
    assert param_layout({1: meta((3,))}).layout == PARTITION
    assert param_layout({1: meta((3,))}, "ddp").layout == REPLICATED
    assert param_layout({0: meta((3,)), 1: meta((3,))}).layout == REPLICATED
    with pytest.raises(ValueError, match="different shapes"):
        param_layout({0: meta((3,)), 1: meta((4,))})
    with pytest.raises(ValueError, match="plain tensor"):
        param_layout({0: meta((2, 4), global_shape=[3, 4], offset=[0, 0]), 1: meta((1, 4))})
    with pytest.raises(ValueError, match="hold 8 of its 12"):
        param_layout({0: meta((2, 4), global_shape=[3, 4], offset=[0, 0])})


def test_step_helpers():
    assert positions(np.array([5, 3, 4]), np.array([3, 5])).tolist() == [1, 0]
    assert step_ranges([3, 4, 5, 9]) == [[3, 5], [9, 9]]


# -- a sharded job ---------------------------------------------------------------------------------------------------
def test_open_run_on_the_job_path_reads_the_whole_tensors(sharded):
    single, path = sharded
    with upd.open_run(single) as run, upd.open_run(path) as job:
        assert isinstance(job, Job) and job.world_size == WORLD and sorted(job.ranks) == [0, 1, 2]
        assert job.parallelism == "fsdp" and job.missing_ranks == {}
        assert [p.name for p in job.iter_params()] == [p.name for p in run.iter_params()]
        for p in run.iter_params():
            q = job.param(p.name)
            assert q.layout == SHARDED and q.shape == p.shape and q.num_rows == p.num_rows
            assert (q.records == p.records).all() and q.kinds == p.kinds and q.state_keys == p.state_keys
            for kind in p.kinds:
                assert torch.equal(q.read(kind), p.read(kind))
                assert torch.equal(q.read(kind, 2), p.read(kind, 2))
                assert torch.equal(q.read(kind, [0, 3]), p.read(kind, [0, 3]))
            for row in range(p.num_rows):
                expected, got = p.state_at(row), q.state_at(row)
                assert expected.keys() == got.keys()
                assert all(torch.equal(expected[k], got[k]) for k in expected)
            blocks = list(q.iter_blocks(["param", "grad"], block_bytes=q.numel * 8 * 2 * 3))
            assert len(blocks) == 2 and torch.equal(torch.cat([b["grad"] for _, b in blocks]), p.read("grad"))
        assert job.param("fc2.weight").ranks == [0, 1, 2]  # rank 2's part is empty
        assert job.param("fc2.weight").shards[2] == ((4, 0), (0, 12))
        # the single process also logs its total gradient norms; a rank of a sharded job cannot (a part of them)
        pd.testing.assert_frame_equal(job.steps(), run.steps().drop(
            columns=[schema.SCALAR_GRAD_NORM_BACKWARD, schema.SCALAR_GRAD_NORM_AT_STEP]))
        params = job.params()
        pd.testing.assert_frame_equal(params.drop(columns=["layout", "ranks"]), run.params())
        assert set(params["layout"]) == {SHARDED}


def test_ratios_of_a_job_are_those_of_the_whole_tensors(sharded):
    single, path = sharded
    with upd.open_run(single) as run, upd.open_run(path) as job:
        pd.testing.assert_frame_equal(job.ratios(source="tensors"), run.ratios(source="tensors"))
        # statistics are stored as float32: combined exactly, up to that rounding
        expected, got = run.ratios(source="stats"), job.ratios(source="stats")
        assert list(got.columns) == list(expected.columns) and len(got) == len(expected) == 16
        pd.testing.assert_frame_equal(got.drop(columns=["flag"]), expected.drop(columns=["flag"]), rtol=1e-5,
                                      atol=1e-6)
        stats, whole = job.stats(), run.stats()
        assert list(stats.columns) == list(whole.columns)
        numbers = whole.select_dtypes("number").columns
        pd.testing.assert_frame_equal(stats[numbers], whole[numbers], rtol=2e-5, atol=1e-6)
        assert job.dumps().columns.tolist() == ["rank", "optimizer", "reason", "trigger_step", "steps", "wall_time"]


def test_analyze_and_verify_take_the_job(sharded, tmp_path):
    _, path = sharded
    analysis = upd.analyze(path, out_dir=str(tmp_path / "plots"))
    assert len(analysis.summary) == 4 and len(analysis.plots) == 4
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH
    assert list(report.checks.columns) == CHECK_COLUMNS[:1] + ["rank"] + CHECK_COLUMNS[1:]
    assert sorted(report.checks["rank"].unique()) == [0, 1, 2]
    skipped = report.checks[report.checks["status"] == "skipped"]
    assert set(zip(skipped["rank"], skipped["param"])) == {(2, "fc2.weight"), (2, "fc2.bias")}  # empty parts
    assert "distributed job of 3 processes" in report.summary()


def test_a_single_file_verify_has_no_rank_column(sharded):
    single, _ = sharded
    report = upd.verify(single)
    assert list(report.checks.columns) == CHECK_COLUMNS
    assert "first_mismatch_rank" not in report.by_param() and "distributed" not in report.summary()


def test_a_corrupted_shard_fails_verify_naming_its_rank(sharded, tmp_path):
    _, path = sharded
    path = copy_job(path, tmp_path)
    with h5py.File(rank_path(path, 1, WORLD), "r+") as f:  # rank 1's update of fc1.weight at row 2, doubled
        group = f[schema.PARAMETER.path(k=0, name="fc1.weight")]
        before, after = group["param"][2], group["param_after"][2]
        group["param_after"][2] = before + 2 * (after - before)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    assert set(zip(bad["rank"], bad["param"], bad["step"])) == {(1, "fc1.weight", 2)}
    row = report.by_param().set_index("param").loc["fc1.weight"]
    assert row["first_mismatch_rank"] == 1 and row["first_mismatch_step"] == 2
    assert row["explanation"].startswith("rank 1: recorded update differs from the replayed one")
    assert "MISMATCH fc1.weight step 2 rank 1:" in report.summary()
    result = run_cli("verify", path)
    assert result.exit_code == EXIT_MISMATCH and "rank" in result.output.splitlines()[1].split()  # first mismatch's


def test_a_missing_rank_file_is_an_error_naming_the_rank_and_the_file(sharded, tmp_path):
    _, path = sharded
    path = copy_job(path, tmp_path)
    os.remove(rank_path(path, 2, WORLD))
    with pytest.raises(upd.RunFileError, match=r"rank 2 of 3 is missing: .*job\.rank2-of-3\.h5"):
        upd.open_run(path)
    for command in ("info", "analyze", "verify"):
        result = run_cli(command, path)
        assert result.exit_code == EXIT_UNUSABLE and "rank 2 of 3 is missing" in result.output


def test_rank_files_of_two_world_sizes_are_an_error(sharded, tmp_path):
    _, path = sharded
    path = copy_job(path, tmp_path)
    shutil.copy(rank_path(path, 0, WORLD), rank_path(path, 0, 2))
    with pytest.raises(upd.RunFileError, match="several world sizes"):
        upd.open_run(path)
    assert run_cli("info", path).exit_code == EXIT_UNUSABLE


def test_a_rank_file_named_for_another_rank_is_refused(sharded, tmp_path):
    _, path = sharded
    path = copy_job(path, tmp_path)
    shutil.copy(rank_path(path, 0, WORLD), rank_path(path, 1, WORLD))
    with pytest.raises(upd.RunFileError, match="named as rank 1 of 3, but its metadata says rank 0 of 3"):
        upd.open_run(path)


def test_a_rank_file_cut_short_leaves_the_job_readable_up_to_the_common_steps(sharded, tmp_path):
    single, path = sharded
    path = copy_job(path, tmp_path)
    with h5py.File(rank_path(path, 2, WORLD), "r+") as f:  # as a kill after step 1 leaves it: steps 2, 3 uncommitted
        for table in (schema.RECORD_TABLE, schema.STATS_TABLE):
            f[table.at(schema.COMMIT_COLUMN, k=0)].resize(2, axis=0)
    with upd.open_run(path) as job, upd.open_run(single) as run:
        assert job.optimizers[0].steps.tolist() == [0, 1] and job.missing_ranks == {2: [2, 3]}
        assert torch.equal(job.param("fc1.weight").read("param_after"),
                           run.param("fc1.weight").read("param_after", slice(0, 2)))
        assert sorted(job.ratios(source="stats")["step"].unique()) == [0, 1]
        assert job.describe()["job"]["ranks"][2]["lacks_steps"] == [[2, 3]]
    result = run_cli("info", path)
    assert result.exit_code == 0 and "rank 2: job.rank2-of-3.h5" in result.output
    assert "lacks steps 2..3" in result.output
    assert run_cli("verify", path).exit_code == EXIT_MATCH


def test_info_shows_the_world_size_ranks_and_layouts(sharded):
    _, path = sharded
    result = run_cli("info", path)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{path}: torch-upd job of 3 processes (fsdp), 3 rank files, format v1")
    assert sum(line.startswith("  rank ") for line in lines) == 3
    assert any("fc2.weight" in line and line.endswith("sharded on ranks 0,1,2") for line in lines)
    one = run_cli("info", rank_path(path, 1, WORLD))
    assert one.exit_code == 0 and "rank 1 of a job of 3 processes (fsdp)" in one.output
    assert "4x12" not in one.output and "2x12" in one.output  # a rank's file alone holds its part


# -- partitions and replicas -------------------------------------------------------------------------------------------
def record_partition(path: str, world: int, include) -> str:
    """One model trained once per rank, each rank's file recording the parameters `include` gives it."""
    for rank in range(world):
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with upd.record(rank_path(path, rank, world), model, optimizer, include=include(rank), stats_every=1, every=1):
            train_steps(model, optimizer, steps=3)
    return path


def test_a_partitioned_job_reads_each_parameter_from_its_rank(tmp_path):
    single = record_run(str(tmp_path / "single.h5"), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        steps=3, stats_every=1)
    path = record_partition(str(tmp_path / "zero.h5"), 2, lambda rank: ["fc1.*"] if rank == 0 else ["fc2.*"])
    with upd.open_run(path) as job, upd.open_run(single) as run:
        assert {p.name: (p.layout, p.ranks) for p in job.iter_params()} == {
            "fc1.weight": (PARTITION, [0]), "fc1.bias": (PARTITION, [0]),
            "fc2.weight": (PARTITION, [1]), "fc2.bias": (PARTITION, [1])}
        for p in run.iter_params():
            assert torch.equal(job.param(p.name).read("param_after"), p.read("param_after"))
            assert torch.equal(job.param(p.name).state_at(1)["momentum_buffer"], p.state_at(1)["momentum_buffer"])
        pd.testing.assert_frame_equal(job.ratios().sort_values("param", kind="stable").reset_index(drop=True),
                                      run.ratios().sort_values("param", kind="stable").reset_index(drop=True))
        pd.testing.assert_frame_equal(job.stats(), run.stats())
        report = upd.verify(job)
    assert report.exit_code == EXIT_MATCH and len(report.checks) == 12


def test_replicas_are_read_from_rank_0_and_a_diverging_one_fails_verify(tmp_path):
    path = record_partition(str(tmp_path / "ddp.h5"), 2, lambda rank: None)
    with upd.open_run(path) as job:
        assert {p.layout for p in job.iter_params()} == {REPLICATED}
        assert job.param("fc1.weight").ranks == [0, 1]
        assert upd.verify(job).exit_code == EXIT_MATCH
    with h5py.File(rank_path(path, 1, 2), "r+") as f:  # rank 1's replica drifts at step 1
        ds = f[schema.PARAMETER.at("param", k=0, name="fc2.bias")]
        ds[1] = ds[1] + np.float32(1e-3)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    replica = bad[bad["note"].str.startswith("replica on rank 1")]
    assert replica[["rank", "param", "step"]].values.tolist() == [[1, "fc2.bias", 1]]


def test_stitching_follows_the_recorded_offsets(sharded, tmp_path):
    """The check above fails when it should: two ranks' offsets swapped put their parts in each other's place."""
    single, path = sharded
    path = copy_job(path, tmp_path)
    for rank, offset in ((0, [4]), (1, [0])):
        with h5py.File(rank_path(path, rank, WORLD), "r+") as f:
            group = f[schema.PARAMETER.path(k=0, name="fc1.bias")]
            meta = json.loads(group.attrs[schema.ATTR_META])
            group.attrs[schema.ATTR_META] = json.dumps({**meta, "offset": offset})
            del f[schema.PARAMS_GROUP.path(k=0)].attrs[schema.PARAM_INDEX]  # it repeats the metadata changed above
    with upd.open_run(path) as job, upd.open_run(single) as run:
        whole, swapped = run.param("fc1.bias").read("param"), job.param("fc1.bias").read("param")
        assert not torch.equal(swapped, whole)
        assert torch.equal(swapped[:, :4], whole[:, 4:8]) and torch.equal(swapped[:, 4:8], whole[:, :4])
