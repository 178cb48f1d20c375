"""DeepSpeed ZeRO stages 1, 2 and 3 on the CPU (DS_ACCELERATOR=cpu, gloo, 2 ranks): every rank records its
partition of the fp32 master weights, and the job reads as the model's parameters, whole, with their names and
shapes, equal to the same training in one process.

One torchrun job (tests/harness/scripts/train_deepspeed.py, module fixture `job`) trains a small transformer-like
block whose parameter sizes do not divide 2 (partition boundaries fall inside parameters), in two param groups (so
DeepSpeed steps its optimizer twice per step), with gradient clipping, under ZeRO-1, ZeRO-2 and ZeRO-3 with AdamW,
ZeRO-2 with SGD and momentum (ranks="all"), ZeRO-2 with the optimizer offloaded to the CPU (refused with one
warning), and the Hugging Face Trainer with a DeepSpeed ZeRO-2 config and UpdCallback. The references train the same block on the whole global batch in this process, plain torch.

Tolerance: stitched tensors equal the reference's within 1e-6 absolute (float32: DeepSpeed sums the ranks'
gradients in another order; the largest difference seen is 1.2e-7), ratios (log10) within 1e-4. Rank 0's live sink
gets the job file's own ratios within 1e-6 (log10; both merge the same parts' statistics, in float64).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import h5py
import numpy as np
import pytest
import torch

import upd
from upd.exit_codes import EXIT_MATCH, EXIT_MISMATCH
from upd.runfile import schema
from tests.harness.distributed import torchrun_script
from tests.harness.paths import REPO_ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")]

SCRIPT = os.path.join(REPO_ROOT, "tests", "harness", "scripts", "train_deepspeed.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import train_deepspeed as ds_job  # noqa: E402  (the job's model, data and reference training)

RECORDED = ["1-adamw", "2-adamw", "3-adamw", "2-sgd"]
ATOL, RATIO_ATOL, LIVE_ATOL = 1e-6, 1e-4, 1e-6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("deepspeed"))
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        done = torchrun_script(SCRIPT, folder, *RECORDED, "2-offload", "hf", cwd=folder, timeout=600)
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR")
        else:
            os.environ["DS_ACCELERATOR"] = saved
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    references = {}
    for name in ("adamw", "sgd"):
        references[name] = os.path.join(folder, f"reference-{name}.h5")
        ds_job.reference(name, references[name], stats_every=1)
    return folder, references


def _paths(job, config):
    folder, references = job
    return os.path.join(folder, f"{config}.h5"), references[config.split("-")[1]]


@pytest.mark.parametrize("config", RECORDED)
def test_every_parameter_whole_with_its_name_and_shape_equal_to_one_process(job, config):
    path, reference = _paths(job, config)
    model = ds_job.Block()
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    with open(os.path.join(job[0], f"{config}.names.json")) as f:
        assert [(n, tuple(s)) for n, s in json.load(f)] == expected  # what the engine's module holds
    with upd.open_run(path) as run, upd.open_run(reference) as ref:
        assert run.parallelism == schema.DEEPSPEED and run.world_size == 2
        table = run.params()
        assert sorted(zip(table["param"], table["shape"])) == sorted(expected)  # no "module." prefix
        assert set(table["layout"]) == {"sharded"} and run.params_not_optimized == []
        assert "fp32 master weights" in run.meta[schema.META_DISTRIBUTED][schema.META_RECORDED_WEIGHTS]
        # Every partition boundary falls inside a parameter: some parameter has parts on both ranks.
        assert any(len(ranks) == 2 for ranks in table["ranks"])
        job_opt, ref_opt = run.optimizers[0], ref.optimizers[0]
        assert job_opt.class_name == ref_opt.class_name and job_opt.num_records == ds_job.STEPS
        for name, _ in expected:
            got, want = job_opt.param_records[name], ref_opt.param_records[name]
            for kind in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER):
                torch.testing.assert_close(got.read(kind), want.read(kind), atol=ATOL, rtol=0, msg=f"{name} {kind}")
            state = got.state_at(1)
            for key, value in ref_opt.param_records[name].state_at(1).items():
                torch.testing.assert_close(state[key].reshape(value.shape), value, atol=ATOL, rtol=0)
        for source in ("tensors", "stats"):
            ours = run.ratios(source=source).set_index(["param", "step"]).sort_index()
            theirs = ref.ratios(source=source).set_index(["param", "step"]).sort_index()
            for column in ("update_to_data", "grad_to_data"):
                np.testing.assert_allclose(ours[column], theirs[column], atol=RATIO_ATOL, rtol=0)
        # What DeepSpeed did to the gradient before its optimizer saw it: the pre-clip norm, scale and threshold.
        pre_clip = ref.optimizers[0].scalars()["total_grad_norm_backward"].to_numpy()
        for record in range(job_opt.num_records):
            group = job_opt.hparams(record)[0]
            assert group["deepspeed_gradient_clipping"] == ds_job.CLIP and group["deepspeed_loss_scale"] == 1.0
            assert group["deepspeed_grad_norm"] == pytest.approx(pre_clip[record], rel=1e-5)


@pytest.mark.parametrize("config", RECORDED)
def test_live_sinks_get_every_named_parameter_whole_equal_to_the_file(job, config):
    """Rank 0's sink gets, at every step, one value per named model parameter: the whole parameter's ratios (the
    ranks' parts merged), equal to the job file's."""
    path, _ = _paths(job, config)
    with open(os.path.join(job[0], f"{config}.sink.json")) as f:
        live = json.load(f)
    with upd.open_run(path) as run:
        names = sorted(run.params()["param"])
        ratios = run.ratios().set_index(["param", "step"]).sort_index()
    assert [step for step, _ in live] == list(range(ds_job.STEPS))
    for step, params in live:
        assert sorted(params) == names, step
        for name in names:
            for column in ("update_to_data", "grad_to_data"):
                assert params[name][column] == pytest.approx(ratios.loc[(name, step), column], abs=LIVE_ATOL), \
                    (name, step, column)


@pytest.mark.parametrize("config", RECORDED)
def test_info_and_analyze_list_no_recorded_parameter_as_frozen(job, config):
    from click.testing import CliRunner

    from upd.cli.main import main

    path, _ = _paths(job, config)
    for command in (["info", path], ["analyze", path, "--no-plots"]):
        result = CliRunner().invoke(main, command, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "frozen" not in result.output, result.output


@pytest.mark.parametrize("config", RECORDED)
def test_verify_replays_every_partition(job, config):
    path, _ = _paths(job, config)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH, report.summary()
    assert set(report.checks["rank"]) == {0, 1} and report.mismatched == 0
    if config == "2-sgd":  # recorded with ranks="all": partitions are never compared as replicas
        assert "replica" not in " ".join(report.checks["note"].fillna(""))


def test_a_corrupted_partition_fails_verify_naming_the_rank_and_the_parameter(job, tmp_path):
    from click.testing import CliRunner

    from upd.cli.main import main

    path, _ = _paths(job, "2-adamw")
    target = str(tmp_path / "2-adamw.h5")
    for rank in (0, 1):
        shutil.copy(path.replace(".h5", f".rank{rank}-of-2.h5"), target.replace(".h5", f".rank{rank}-of-2.h5"))
    with upd.open_run(target) as run:
        victim = next(n for n, p in run.optimizers[0].param_records.items() if p.ranks == [1])
    with h5py.File(target.replace(".h5", ".rank1-of-2.h5"), "r+") as f:
        key = schema.param_key(victim)
        group = f[f"{schema.OPTIMIZERS}/0/{schema.PARAMS}/{key}"]
        data = group[schema.KIND_PARAM_AFTER]
        row = data[1]
        row[0] += 0.5
        data[1] = row
    result = CliRunner().invoke(main, ["verify", target], catch_exceptions=False)
    assert result.exit_code == EXIT_MISMATCH, result.output
    assert "rank 1" in result.output and victim in result.output
    assert "frozen" not in result.output  # every parameter was recorded and checked
    assert upd.verify(path).exit_code == EXIT_MATCH  # the job it was copied from still verifies


@pytest.mark.parametrize("config", RECORDED)
def test_recording_starts_without_a_warning(job, config):
    """Nothing of what upd.record does to find the engine and its ZeRO optimizer (a scan of the live objects,
    which touches deprecated module attributes) reaches the user."""
    with open(os.path.join(job[0], f"{config}.warnings.json")) as f:
        assert json.load(f) == []


def test_an_unsupported_option_warns_once_naming_it_and_writes_no_file(job):
    folder, _ = job
    with open(os.path.join(folder, "2-offload.warnings.json")) as f:
        warned = json.load(f)
    assert len(warned) == 1 and warned[0][0] == "RecorderWarning" and "offload" in warned[0][1], warned
    assert not [name for name in os.listdir(folder) if name.startswith("2-offload") and name.endswith(".h5")]


def test_the_hf_trainer_with_a_deepspeed_config_and_upd_callback_records_the_same(job):
    """The Trainer's DeepSpeed path (Accelerate's DeepSpeedOptimizerWrapper around the ZeRO optimizer, the client
    optimizer reached by the callback): every parameter whole under its model name, verified, and its last record's
    parameters after the step equal to the trained model's."""
    folder, _ = job
    path = os.path.join(folder, "hf.h5")
    with open(os.path.join(folder, "hf.names.json")) as f:
        expected = sorted((n, tuple(s)) for n, s in json.load(f))
    final = np.load(os.path.join(folder, "hf.final.npz"), allow_pickle=False)
    with upd.open_run(path) as run:
        assert run.parallelism == schema.DEEPSPEED and run.world_size == 2
        table = run.params()
        assert sorted(zip(table["param"], table["shape"])) == expected
        assert any(len(ranks) == 2 for ranks in table["ranks"])
        opt = run.optimizers[0]
        assert opt.num_records == ds_job.STEPS
        for name, _ in expected:
            after = opt.param_records[name].read(schema.KIND_PARAM_AFTER, opt.num_records - 1)
            np.testing.assert_allclose(after.numpy(), final[name], atol=1e-6, rtol=0)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH, report.summary()
