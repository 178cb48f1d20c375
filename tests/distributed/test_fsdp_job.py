"""A real FSDP2 job read whole: ``upd.open_run(path)``, ``upd analyze`` and ``upd verify`` given the job's path.

2 and 3 gloo processes train a tiny transformer under torch.distributed.fsdp.fully_shard, recorded on every rank
into one file each. Its parameters shard unevenly (on 3 ranks: 16 embedding rows as 6+6+4, 8 norm scales as 3+3+2)
and the 2-row head leaves rank 2 of 3 without any part of it (1+1+0). Each rank trains on its slice of a global
batch and FSDP2 averages the gradients, so the job computes what one process computes on the whole batch: that
single-process run, recorded here, is the reference. The stitched tensors and the ratios of the job must equal the
reference's to float32 rounding (FSDP2 reduces the gradients in another order than one process sums them):
tensors within RTOL/ATOL, ratios (log10) within RATIO_ATOL.
"""
from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from tests.harness.distributed import job_path, record_references, run_job
from upd.cli.main import main
from upd.replay.engine import EXIT_MATCH, EXIT_MISMATCH, EXIT_UNUSABLE
from upd.runfile import schema
from upd.runfile.ranks import rank_path

pytestmark = pytest.mark.slow

VOCAB, DIM, HEADS, FFN, CLASSES, SEQ = 16, 8, 2, 12, 2, 4
GLOBAL_BATCH = 6  # divisible by 2 and 3: every rank gets an equal slice
STEPS = 4
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}
# full: full records (and statistics of the CPU copies); stats: statistics only, computed on the device
MODES = {"full": {"every": 1, "stats_every": 1}, "stats": {"every": None, "stats_every": 1, "full_stats_every": 1}}
JOBS = [(opt, mode) for opt in OPTIMIZERS for mode in MODES]
RTOL, ATOL = 1e-4, 1e-6
RATIO_ATOL = 1e-4


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        # No biases in the block: attention's key bias has an exactly zero gradient (softmax ignores it), which
        # Adam would turn from summation noise into full-size updates of either sign.
        self.block = nn.TransformerEncoderLayer(DIM, HEADS, FFN, dropout=0.0, batch_first=True, bias=False)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)).mean(dim=1))


def make_model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer()


def global_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g))


def train(model, optimizer, rows: slice) -> None:
    for step in range(STEPS):
        tokens, labels = global_batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(tokens[rows]), labels[rows]).backward()
        optimizer.step()


def fsdp_worker(rank: int, world_size: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    for opt_name, mode in JOBS:
        model = make_model()
        for module in (model.embed, model.block, model.head):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = OPTIMIZERS[opt_name](model.parameters())
        with upd.record(job_path(folder, opt_name, mode), model, optimizer, strict=True, **{"every": 1, **MODES[mode]}):
            train(model, optimizer, rows)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """The single-process run of each optimizer on the whole batch, full records and statistics: {opt: path}."""
    return record_references(tmp_path_factory.mktemp("reference"), OPTIMIZERS, make_model, train, stats_every=1)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def fsdp_job(request, tmp_path_factory) -> tuple[int, str]:
    """(world size, folder of the jobs' files)."""
    world = request.param
    folder = str(tmp_path_factory.mktemp(f"fsdp{world}"))
    run_job(fsdp_worker, world, folder)
    return world, folder


def cli(*args):
    return CliRunner().invoke(main, list(args))


def copy_job(path: str, world: int, folder) -> str:
    target = os.path.join(str(folder), os.path.basename(path))
    for rank in range(world):
        shutil.copy(rank_path(path, rank, world), rank_path(target, rank, world))
    return target


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_full_records_stitch_into_the_single_process_run(fsdp_job, references, opt_name):
    world, folder = fsdp_job
    with upd.open_run(job_path(folder, opt_name, "full")) as job, upd.open_run(references[opt_name]) as ref:
        assert job.world_size == world and job.parallelism == "fsdp" and job.missing_ranks == {}
        assert [p.name for p in job.iter_params()] == [p.name for p in ref.iter_params()]
        for p in ref.iter_params():
            q = job.param(p.name)
            assert q.layout == "sharded" and q.shape == p.shape and q.num_rows == p.num_rows == STEPS
            for kind in ("param", "grad", "param_after"):
                assert_close(q.read(kind), p.read(kind), f"{p.name} {kind}")
            assert_close(q.read("param_after") - q.read("param"), p.read("param_after") - p.read("param"),
                         f"{p.name} update")
            expected, got = p.state_at(STEPS - 1), q.state_at(STEPS - 1)
            assert expected.keys() == got.keys()
            for key in expected:
                assert_close(got[key], expected[key], f"{p.name} state {key}")
        if world == 3:  # 2 rows on 3 ranks: 1 + 1 + 0, rank 2 holds an empty part
            assert job.param("head.weight").shards[2][1] == (0, DIM)
        # A rank holds part of each gradient, so a sharded job has no total gradient norms; the rest is the same.
        assert not set(schema.RECORDER_SCALARS) & set(job.steps().columns)
        pd.testing.assert_frame_equal(job.steps().drop(columns="wall_time"), ref.steps().drop(
            columns=["wall_time", *schema.RECORDER_SCALARS], errors="ignore"))


def compare_ratios(got: pd.DataFrame, expected: pd.DataFrame) -> None:
    merged = expected.merge(got, on=["optimizer", "param", "step"], suffixes=("", "_job"), validate="1:1")
    assert len(merged) == len(expected) == len(got)
    for column in ("update_to_data", "grad_to_data"):
        worst = float((merged[column] - merged[f"{column}_job"]).abs().max())
        assert worst <= RATIO_ATOL, f"{column}: {worst:.3g}"
    for column in ("update_norm", "grad_norm", "param_norm", "param_std"):
        np.testing.assert_allclose(merged[f"{column}_job"], merged[column], rtol=RTOL, err_msg=column)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_ratios_and_statistics_equal_the_single_process_run(fsdp_job, references, opt_name, mode):
    world, folder = fsdp_job
    with upd.open_run(job_path(folder, opt_name, mode)) as job, upd.open_run(references[opt_name]) as ref:
        # full: from the stitched tensors; stats: from the shards' statistics, combined
        compare_ratios(job.ratios(), ref.ratios(source="tensors"))
        stats, whole = job.stats(), ref.stats()
        assert len(stats) == len(whole)
        for kind in ("param", "grad", "update"):
            for stat in ("mean", "std", "norm", "absmax"):
                column = f"{kind}_{stat}"
                np.testing.assert_allclose(stats[column], whole[column], rtol=1e-4, atol=1e-7, err_msg=column)
            assert (stats[f"{kind}_nonfinite"] == 0).all()


def test_analyze_and_verify_take_the_job_path(fsdp_job, tmp_path):
    world, folder = fsdp_job
    for opt_name in OPTIMIZERS:
        path = job_path(folder, opt_name, "full")
        result = cli("verify", path)
        assert result.exit_code == EXIT_MATCH, result.output
        assert f"distributed job of {world} processes" in result.output
        # The figures once (their histograms read the stitched full records); the table for the other optimizer.
        figures = ["--out", str(tmp_path / opt_name)] if opt_name == "adamw" else ["--no-plots"]
        result = cli("analyze", path, *figures)
        assert result.exit_code == 0, result.output
        assert "head.weight" in result.output
    info = cli("info", job_path(folder, "adamw", "stats"))
    assert info.exit_code == 0 and f"torch-upd job of {world} processes (fsdp)" in info.output
    assert "0 full-tensor records" in info.output and "sharded on ranks" in info.output


def test_a_corrupted_shard_fails_verify_naming_its_rank(fsdp_job, tmp_path):
    world, folder = fsdp_job
    path = copy_job(job_path(folder, "sgd", "full"), world, tmp_path)
    with h5py.File(rank_path(path, world - 1, world), "r+") as f:
        ds = f[schema.PARAMETER.at("param_after", k=0, name="block.linear1.weight")]
        ds[1] = ds[1] + np.float32(0.01)
    report = upd.verify(path)
    bad = report.checks[report.checks["status"] == "mismatch"]
    assert set(zip(bad["rank"], bad["param"], bad["step"])) == {(world - 1, "block.linear1.weight", 1)}
    result = cli("verify", path)
    assert result.exit_code == EXIT_MISMATCH
    assert f"MISMATCH block.linear1.weight step 1 rank {world - 1}:" in result.output


def test_a_missing_rank_file_exits_2(fsdp_job, tmp_path):
    world, folder = fsdp_job
    path = copy_job(job_path(folder, "adamw", "full"), world, tmp_path)
    os.remove(rank_path(path, 1, world))
    for command in ("info", "analyze", "verify"):
        result = cli(command, path)
        assert result.exit_code == EXIT_UNUSABLE
        assert f"rank 1 of {world} is missing: {rank_path(path, 1, world)}" in result.output


def test_a_rank_file_cut_short_leaves_the_job_readable_up_to_the_common_steps(fsdp_job, references, tmp_path):
    world, folder = fsdp_job
    path = copy_job(job_path(folder, "adamw", "full"), world, tmp_path)
    kept = 2
    with h5py.File(rank_path(path, 0, world), "r+") as f:  # what a kill after 2 committed steps leaves
        for table in (schema.RECORD_TABLE, schema.STATS_TABLE):
            f[table.at(schema.COMMIT_COLUMN, k=0)].resize(kept, axis=0)
    with upd.open_run(path) as job, upd.open_run(references["adamw"]) as ref:
        assert job.missing_ranks == {0: list(range(kept, STEPS))}
        assert job.optimizers[0].steps.tolist() == list(range(kept))
        p = ref.param("embed.weight")
        assert_close(job.param("embed.weight").read("param_after"), p.read("param_after", slice(0, kept)),
                     "embed.weight")
        assert sorted(job.ratios()["step"].unique()) == list(range(kept))
    result = cli("info", path)
    assert result.exit_code == 0 and f"lacks steps {kept}..{STEPS - 1}" in result.output
    assert cli("verify", path).exit_code == EXIT_MATCH
