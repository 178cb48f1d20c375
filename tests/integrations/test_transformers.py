"""Hugging Face Trainer: a real Trainer on a tiny randomly initialised GPT-2, recorded through UpdCallback."""
import importlib.util
import math
import os
import sys
import types

import json

import h5py
import numpy as np
import pytest
import torch

import upd
from tests.harness.clipping import clipping_summary
from upd.runfile import schema

from tests.harness.distributed import run_script_job
from tests.harness.training import MLP, record_run

transformers = pytest.importorskip("transformers", reason="needs the transformers extra "
                                                          '(pip install "torch-upd[transformers]")')
from upd.integrations.transformers import (DEFAULT_FILE, INSTALL_HINT, UpdCallback,  # noqa: E402
                                           torch_optimizer, trainer_logs)

MAX_GRAD_NORM = 0.05  # far below the tiny model's gradient norm (~1.3): every step is clipped
STEPS = 4


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def random_tokens(rows=24, length=16):
    tokens = torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": t, "labels": t} for t in tokens]


def train(output_dir, callback, **arguments):
    args = transformers.TrainingArguments(
        str(output_dir), use_cpu=True, report_to="none", max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="linear",
        learning_rate=1e-3, logging_steps=1, save_strategy="no", disable_tqdm=True, **arguments)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=random_tokens(),
                                   callbacks=[callback])
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One recorded training shared by the checks below (Trainer's defaults: its fused AdamW)."""
    out = tmp_path_factory.mktemp("trainer")
    callback = UpdCallback(every=1)
    trainer = train(out, callback)
    return trainer, callback, os.path.join(out, DEFAULT_FILE)


@pytest.mark.slow
def test_records_the_trainers_optimizer_at_the_default_path_and_verifies(trained):
    trainer, callback, path = trained
    assert callback.recorder is None  # closed at on_train_end
    assert os.path.exists(path)
    inner = trainer.optimizer.optimizer  # Accelerate's AcceleratedOptimizer wraps the torch optimizer
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    with upd.open_run(path) as run:
        meta = run.optimizers[0].meta
        assert meta["class"] == "torch.optim.AdamW"
        assert meta["defaults"]["fused"] == inner.defaults["fused"]
        steps = run.steps()
    if trainer.args.optim.value == "adamw_torch_fused":
        assert meta["defaults"]["fused"] is True
    assert len(steps) == trainer.state.global_step == STEPS
    assert list(np.diff(steps["backward_pass"])) == [2] * (STEPS - 1)  # gradient accumulation 2
    # The scheduler's lr, as the optimizer stepped with it, is what the Trainer logged at that step.
    logged_lr = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert np.allclose(steps["lr_group0"], logged_lr)
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()


@pytest.mark.slow
def test_the_recorded_gradient_is_the_clipped_one(trained):
    _, _, path = trained
    with upd.open_run(path) as run:
        records = run.optimizers[0].param_records
        for row in range(STEPS):
            norm = math.sqrt(sum(float(p.read("grad", row).double().pow(2).sum()) for p in records.values()))
            assert norm == pytest.approx(MAX_GRAD_NORM, rel=1e-3)


@pytest.mark.slow
def test_the_trainers_logs_are_stored_in_the_run(trained):
    trainer, _, path = trained
    history = trainer.state.log_history
    logs = trainer_logs(path)
    assert list(logs.columns)[0] == "step"
    assert list(logs["step"]) == sorted({e["step"] for e in history})  # one row per logged step
    losses = [e["loss"] for e in history if "loss" in e]
    assert len(losses) == STEPS
    assert list(logs["loss"].dropna()) == pytest.approx(losses, rel=1e-12)
    assert list(logs["learning_rate"].dropna()) == [e["learning_rate"] for e in history if "learning_rate" in e]
    with upd.open_run(path) as run:  # an open run reads the same, and run.steps() shows them at each step
        assert trainer_logs(run).equals(logs)
        assert run.params_not_optimized == []
        steps = run.steps()
    assert list(steps["loss"]) == pytest.approx(losses, rel=1e-12)
    assert list(steps["step"] + 1) == [e["step"] for e in history if "loss" in e]
    with h5py.File(path, "r") as f:  # stored as the run format declares it: logged scalars, no root attribute
        assert set(f.attrs) <= {a.name for a in schema.ROOT.attrs}
        assert schema.ATTR_CLOSED_CLEANLY in f.attrs
        assert "loss" in json.loads(f[f"optimizers/0/{schema.SCALARS}"].attrs[schema.SCALAR_COLUMNS])


@pytest.mark.slow
def test_the_gradient_norm_before_clipping_is_the_one_the_trainer_logged(trained):
    """The Trainer logs clip_grad_norm_'s return value: the total norm before clipping. The recorder measures it
    itself at the end of the last backward pass before each step, and the clipped norm the optimizer then saw."""
    trainer, _, path = trained
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    with upd.open_run(path) as run:
        scalars = run.scalars()
        clipping = clipping_summary(run)
    assert list(scalars[schema.SCALAR_GRAD_NORM_BACKWARD]) == pytest.approx(logged, rel=1e-5)
    assert list(scalars[schema.SCALAR_GRAD_NORM_AT_STEP]) == pytest.approx([MAX_GRAD_NORM] * STEPS, rel=1e-4)
    assert (clipping.clipped_steps, clipping.measured_steps) == (STEPS, STEPS)
    assert clipping.clipped_to == pytest.approx(MAX_GRAD_NORM, rel=1e-4)


def test_a_run_recorded_without_the_callback_has_no_logs(tmp_path):
    path = record_run(str(tmp_path / "plain.h5"), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), steps=1)
    logs = trainer_logs(path)
    assert logs.empty and list(logs.columns) == ["step"]


def test_unknown_record_options_are_refused_when_the_callback_is_made():
    with pytest.raises(TypeError):
        UpdCallback(evry=3, every=1)
    UpdCallback(every=3, stats_every=1)


def test_wrappers_are_looked_through_to_the_torch_optimizer():
    opt = torch.optim.SGD(MLP().parameters(), lr=0.1)
    assert torch_optimizer(opt) is opt
    assert torch_optimizer(types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=opt))) is opt


    class OptimizerWrapper(torch.optim.Optimizer):  # as Accelerate's AcceleratedOptimizer: an Optimizer itself
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert torch_optimizer(OptimizerWrapper(OptimizerWrapper(opt))) is opt
    assert torch_optimizer(types.SimpleNamespace(optimizer="not one")).optimizer == "not one"


def _begin(callback, output_dir):
    """on_train_begin as the Trainer calls it."""
    model = MLP()
    args = types.SimpleNamespace(output_dir=str(output_dir))
    callback.on_train_begin(args, None, None, model=model,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_run_that_cannot_start_warns_and_training_goes_on(tmp_path):
    (tmp_path / DEFAULT_FILE).write_bytes(b"an earlier run")
    callback = UpdCallback(every=1)
    with pytest.warns(upd.RecorderWarning, match="exists"):
        _begin(callback, tmp_path)
    assert callback.recorder is None
    callback.on_train_end(None, types.SimpleNamespace(log_history=[{"loss": 1.0, "step": 1}]), None)
    assert (tmp_path / DEFAULT_FILE).read_bytes() == b"an earlier run"
    with pytest.raises(FileExistsError):
        _begin(UpdCallback(strict=True, every=1), tmp_path)


def test_an_explicit_path_and_a_second_train_call(tmp_path):
    callback = UpdCallback(tmp_path / "mine.h5", every=1)
    _begin(callback, tmp_path / "unused")
    first = callback.recorder
    assert first.path == str(tmp_path / "mine.h5") and first.active
    # A train() that raised never reached on_train_end: the next one closes its recorder before starting.
    with pytest.warns(upd.RecorderWarning, match="exists"):
        _begin(callback, tmp_path / "unused")
    assert not first.active and callback.recorder is None
    assert not (tmp_path / "unused").exists()


def test_without_transformers_the_callback_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    import upd.integrations.transformers as real
    spec = importlib.util.spec_from_file_location("upd.integrations._transformers_without", real.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ImportError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        module.UpdCallback(every=1)
    path = record_run(str(tmp_path / "plain.h5"), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), steps=1)
    assert module.trainer_logs(path).empty  # reading needs no transformers


DDP_SCRIPT = '''
import sys, torch, transformers
from upd.integrations.transformers import UpdCallback
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                     n_positions=32, bos_token_id=0, eos_token_id=0))
tokens = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(0))
args = transformers.TrainingArguments(sys.argv[1], use_cpu=True, report_to="none", max_steps=3,
                                      per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
                                      disable_tqdm=True, ddp_backend="gloo")
trainer = transformers.Trainer(model=model, args=args, callbacks=[UpdCallback(every=1)],
                               train_dataset=[{"input_ids": t, "labels": t} for t in tokens])
trainer.train()
assert torch.distributed.get_world_size() == 2 and trainer.state.global_step == 3
'''


@pytest.mark.slow
def test_replicated_training_on_two_processes_records_on_rank_0_alone(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "out"
    # torchrun's variables on two ranks forked from the harness's forkserver (the Trainer initialises the process
    # group from them as under torchrun; the launch itself is test_recipes::test_torchrun_and_ddp's)
    ranks = run_script_job(str(script), str(out), cwd=str(tmp_path), timeout=120)
    assert not any("RecorderWarning" in err for _, err in ranks), ranks
    assert sorted(os.listdir(out)) == [DEFAULT_FILE]  # no rank files: the replicas are identical
    path = str(out / DEFAULT_FILE)
    with upd.open_run(path) as run:
        assert run.meta[schema.META_DISTRIBUTED]["recording_ranks"] == [0]
        assert len(run.steps()) == 3
    assert upd.verify(path).exit_code == 0
    assert list(trainer_logs(path)["loss"].dropna().index) == [0, 1, 2]
