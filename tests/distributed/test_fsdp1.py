"""FSDP1 (FullyShardedDataParallel) with use_orig_params=True and False, 2 and 3 ranks on the CPU (gloo): every
rank records its shard of each flat parameter, and the job reads as the model's parameters, whole, named as in the
model, equal to the same training in one process; verify replays each rank's shards.

One job per world size (tests.harness.distributed.run_job) records both settings: a nested FSDP unit (``up``) inside
the root unit, the small transformer-like block of the DeepSpeed tests (sizes that do not divide 2 or 3), AdamW,
FSDP's own gradient clipping. Tolerance as there: 1e-6 absolute on the tensors, 1e-4 on the log10 ratios.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import upd
from upd.exit_codes import EXIT_MATCH
from upd.runfile import schema
from tests.harness.distributed import run_job
from tests.harness.scripts.train_deepspeed import CLIP, Block, batch

pytestmark = pytest.mark.slow
STEPS = 3
ATOL, RATIO_ATOL = 1e-6, 1e-4


def _record_fsdp1(rank: int, world: int, folder: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for use_orig in (True, False):
        model = Block()
        model.up = FSDP(model.up, use_orig_params=use_orig, device_id=torch.device("cpu"))
        fsdp = FSDP(model, use_orig_params=use_orig, device_id=torch.device("cpu"))
        optimizer = torch.optim.AdamW(fsdp.parameters(), lr=0.05, weight_decay=0.1)
        with upd.record(os.path.join(folder, f"orig-{use_orig}.h5"), fsdp, optimizer, stats_every=1, strict=True):
            for step in range(STEPS):
                tokens, targets = batch(step, 2 * world)
                fsdp(tokens[rank::world], targets[rank::world]).backward()
                fsdp.clip_grad_norm_(CLIP)
                optimizer.step()
                optimizer.zero_grad()


def _reference(path: str, world: int) -> None:
    model = Block()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    with upd.record(path, model, optimizer, stats_every=1, strict=True):
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
    run_job(_record_fsdp1, world, folder, timeout=300)
    reference = os.path.join(folder, "reference.h5")
    _reference(reference, world)
    return folder, reference, world


@pytest.mark.parametrize("use_orig", [True, False], ids=["use_orig_params", "flat_params"])
def test_fsdp1_records_every_parameter_whole_and_verifies(job, use_orig):
    folder, reference, world = job
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
