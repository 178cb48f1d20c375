"""FSDP1 (FullyShardedDataParallel) with use_orig_params=True and False, 2 and 3 ranks on the CPU (gloo): every
rank records its shard of each flat parameter, and the job reads as the model's parameters, whole, named as in the
model, equal to the same training in one process; verify replays each rank's shards.

One job per world size (tests.harness.distributed.run_job) records both settings: a nested FSDP unit (``up``) inside
the root unit, the small transformer-like block of the DeepSpeed tests (sizes that do not divide 2 or 3), AdamW,
FSDP's own gradient clipping, a live sink (``Collect``) on every rank. Tolerance as there: 1e-6 absolute on the
tensors, 1e-4 on the log10 ratios; rank 0's sink gets the job file's own ratios within 1e-6 (log10).
"""
from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
import torch

import upd
from upd.exit_codes import EXIT_MATCH, EXIT_MISMATCH
from upd.runfile import schema
from tests.harness.distributed import run_job
from tests.harness.scripts.train_deepspeed import CLIP, Block, Collect, batch

pytestmark = pytest.mark.slow
STEPS = 3
ATOL, RATIO_ATOL, LIVE_ATOL = 1e-6, 1e-4, 1e-6


def _record_fsdp1(rank: int, world: int, folder: str) -> dict:
    """Records both settings; returns what the live sink got, per setting ([step, {param: {column: value}}])."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    live = {}
    for use_orig in (True, False):
        model = Block()
        model.up = FSDP(model.up, use_orig_params=use_orig, device_id=torch.device("cpu"))
        fsdp = FSDP(model, use_orig_params=use_orig, device_id=torch.device("cpu"))
        optimizer = torch.optim.AdamW(fsdp.parameters(), lr=0.05, weight_decay=0.1)
        sink = Collect()
        with upd.record(os.path.join(folder, f"orig-{use_orig}.h5"), fsdp, optimizer, stats_every=1, strict=True,
                        sinks=[sink], every=1):
            for step in range(STEPS):
                tokens, targets = batch(step, 2 * world)
                fsdp(tokens[rank::world], targets[rank::world]).backward()
                fsdp.clip_grad_norm_(CLIP)
                optimizer.step()
                optimizer.zero_grad()
        live[use_orig] = sink.rows
    return live


def _reference(path: str, world: int) -> None:
    model = Block()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    with upd.record(path, model, optimizer, stats_every=1, strict=True, every=1):
        for step in range(STEPS):
            tokens, targets = batch(step, 2 * world)
            (sum(model(tokens[r::world], targets[r::world]) for r in range(world)) / world).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def job(request, tmp_path_factory):
    world = request.param
    folder = str(tmp_path_factory.mktemp(f"fsdp1-{world}"))
    live = run_job(_record_fsdp1, world, folder, timeout=300)[0]  # rank 0's sinks get the job's statistics
    reference = os.path.join(folder, "reference.h5")
    _reference(reference, world)
    return folder, reference, world, live


@pytest.mark.parametrize("use_orig", [True, False], ids=["use_orig_params", "flat_params"])
def test_fsdp1_records_every_parameter_whole_and_verifies(job, use_orig):
    folder, reference, world, _ = job
    path = os.path.join(folder, f"orig-{use_orig}.h5")
    expected = [(n, tuple(p.shape)) for n, p in Block().named_parameters()]
    with upd.open_run(path) as run, upd.open_run(reference) as ref:
        assert run.parallelism == schema.FSDP1 and run.world_size == world
        table = run.params()
        assert sorted(zip(table["param"], table["shape"])) == sorted(expected)  # no _fsdp_wrapped_module.
        assert set(table["layout"]) == {"sharded"} and run.params_not_optimized == []
        assert any(len(ranks) > 1 for ranks in table["ranks"])
        ours, theirs = run.optimizers[0], ref.optimizers[0]
        assert ours.class_name == theirs.class_name == "torch.optim.AdamW"
        for name, _ in expected:
            for kind in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER):
                torch.testing.assert_close(ours.param_records[name].read(kind), theirs.param_records[name].read(kind),
                                           atol=ATOL, rtol=0, msg=f"{name} {kind}")
        for source in ("tensors", "stats"):
            a = run.ratios(source=source).set_index(["param", "step"]).sort_index()
            b = ref.ratios(source=source).set_index(["param", "step"]).sort_index()
            for column in ("update_to_data", "grad_to_data"):
                np.testing.assert_allclose(a[column], b[column], atol=RATIO_ATOL, rtol=0)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH and report.mismatched == 0, report.summary()
    assert set(report.checks["rank"]) == set(range(world))


@pytest.mark.parametrize("use_orig", [True, False], ids=["use_orig_params", "flat_params"])
def test_live_sinks_get_every_named_parameter_whole_equal_to_the_file(job, use_orig):
    folder, _, _, live = job
    with upd.open_run(os.path.join(folder, f"orig-{use_orig}.h5")) as run:
        names = sorted(run.params()["param"])
        ratios = run.ratios().set_index(["param", "step"]).sort_index()
    assert names == sorted(n for n, _ in Block().named_parameters())
    assert [step for step, _ in live[use_orig]] == list(range(STEPS))
    for step, params in live[use_orig]:
        assert sorted(params) == names, step
        for name in names:
            for column in ("update_to_data", "grad_to_data"):
                assert params[name][column] == pytest.approx(ratios.loc[(name, step), column], abs=LIVE_ATOL), \
                    (name, step, column)


@pytest.mark.parametrize("use_orig", [True, False], ids=["use_orig_params", "flat_params"])
def test_no_command_lists_a_recorded_parameter_as_frozen(job, use_orig):
    from click.testing import CliRunner

    from upd.cli.main import main

    path = os.path.join(job[0], f"orig-{use_orig}.h5")
    # `upd verify` prints the same metadata's frozen list: checked on a DeepSpeed job (test_deepspeed.py).
    for command in (["info", path], ["analyze", path, "--no-plots"]):
        result = CliRunner().invoke(main, command, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "frozen" not in result.output, (command, result.output)


@pytest.mark.parametrize("use_orig", [True, False], ids=["use_orig_params", "flat_params"])
def test_a_corrupted_shard_fails_verify_naming_the_rank_and_the_parameter(job, use_orig, tmp_path):
    """A copy of the job with one value of one rank's part changed: verify exits 1 naming that rank and the
    parameter; the job it was copied from still verifies (the DeepSpeed tests' check, on FSDP1's flat parts)."""
    from click.testing import CliRunner

    from upd.cli.main import main

    folder, _, world, _ = job
    name = f"orig-{use_orig}"
    for rank in range(world):
        shutil.copy(os.path.join(folder, f"{name}.rank{rank}-of-{world}.h5"), tmp_path)
    target, last = str(tmp_path / f"{name}.h5"), world - 1
    with upd.open_run(target) as run:
        victim = next(n for n, p in run.optimizers[0].param_records.items() if last in p.ranks)
    with h5py.File(str(tmp_path / f"{name}.rank{last}-of-{world}.h5"), "r+") as f:
        data = f[f"{schema.OPTIMIZERS}/0/{schema.PARAMS}/{schema.param_key(victim)}/{schema.KIND_PARAM_AFTER}"]
        row = data[1]
        row.flat[0] += 0.5
        data[1] = row
    result = CliRunner().invoke(main, ["verify", target], catch_exceptions=False)
    assert result.exit_code == EXIT_MISMATCH, result.output
    assert f"rank {last}" in result.output and victim in result.output
    assert upd.verify(os.path.join(folder, f"{name}.h5")).exit_code == EXIT_MATCH
