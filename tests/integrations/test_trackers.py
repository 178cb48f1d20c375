"""W&B and MLflow sinks against the real trackers: wandb offline, mlflow on a temporary sqlite database.

What each tracker holds is read back with its own format or API (the offline run's .wandb records through wandb's
protobuf classes, ``MlflowClient.get_metric_history``) and compared with ``run.ratios()`` / ``run.scalars()`` of the
same torch-upd run, step by step. Importing wandb and mlflow and creating an MLflow database take seconds, so this
module makes them once (module-scoped fixtures) and every test here is marked slow.
"""
import os
import threading
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd.sinks.base import SinkStep
from upd.sinks.export import export_run, sink_steps

from tests.harness import trackers

pytestmark = pytest.mark.slow
STEPS = 12


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """wandb offline under a temporary folder, mlflow on a temporary sqlite database, for the whole module."""
    folder = tmp_path_factory.mktemp("trackers")
    uri = "sqlite:///" + str(folder / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DIR", str(folder))
        mp.setenv("WANDB_PROJECT", "upd-tests")
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(folder)  # nothing written into the repository (mlflow.db, wandb/)
        import mlflow
        from mlflow.tracking import MlflowClient

        mlflow.set_tracking_uri(uri)
        yield {"folder": str(folder), "uri": uri, "client": MlflowClient(uri)}
        mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real training run (Adam on a small MLP, the loss logged, statistics every step, full records every 5th):
    its path, ratios and scalars."""
    path = train_live(str(tmp_path_factory.mktemp("run") / "run.h5"), (), STEPS, every=5, stats_every=1)
    with upd.open_run(path) as run:
        return {"path": path, "ratios": run.ratios(), "scalars": run.scalars()}


def expected_scalars(scalars, offset=0):
    names = [c for c in scalars.columns if c not in ("optimizer", "step", "wall_time")]
    return {f"scalars/{n}": sorted((int(s) + offset, float(v)) for s, v in zip(scalars["step"], scalars[n]))
            for n in names}


def test_sink_steps_are_the_runs_steps_in_order(recorded):
    steps = list(sink_steps(recorded["ratios"], recorded["scalars"]))
    assert [s.step for s in steps] == list(range(STEPS))
    assert all(isinstance(s, SinkStep) and s.optimizer == 0 and s.wall_time > 0 for s in steps)
    assert sorted(steps[0].params) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert set(steps[3].scalars) == {"loss", "total_grad_norm_backward", "total_grad_norm_step"}


def test_wandb_offline_run_holds_every_step_of_the_run(tracker_env, recorded):
    from upd.sinks.wandb import WandB

    sink = WandB(name="export")
    run_id = sink.run.id
    assert export_run_tables(recorded, sink) == STEPS
    rows = trackers.wandb_history(trackers.wandb_offline_file(tracker_env["folder"], run_id))
    assert len(rows) == STEPS and [r["_step"] for r in rows] == list(range(STEPS))  # one log call per step
    got = trackers.series_from_rows(rows, "upd/step")
    expected = trackers.expected_series(recorded["ratios"])
    assert len(expected) == 20  # 4 parameters x 5 columns
    trackers.assert_same_series(got, expected)
    trackers.assert_same_series(got, expected_scalars(recorded["scalars"]))
    # The comparison catches a dropped step and a shifted one.
    with pytest.raises(AssertionError, match="steps"):
        trackers.assert_same_series(trackers.series_from_rows(rows[:5] + rows[6:], "upd/step"), expected)
    shifted = [{**r, "upd/step": r["upd/step"] + 1} for r in rows]
    with pytest.raises(AssertionError, match="steps"):
        trackers.assert_same_series(trackers.series_from_rows(shifted, "upd/step"), expected)


def export_run_tables(recorded, sink):
    with upd.open_run(recorded["path"]) as run:
        return export_run(run, sink)


def test_wandb_sink_writes_into_the_active_run_beside_the_users_logs(tracker_env, recorded):
    import wandb

    from upd.sinks.wandb import WandB

    run = wandb.init(name="user-run")
    try:
        with pytest.raises(TypeError, match="already active"):
            WandB(project="other")
        sink = WandB(step_metric="train/global_step", step_offset=1)
        assert sink.run is run and not sink.owns_run
        steps = list(sink_steps(recorded["ratios"], recorded["scalars"]))
        for batch in (steps[:5], steps[5:]):  # the user's own rows arrive between the sink's batches
            wandb.log({"user/loss": 1.0})
            writer = threading.Thread(target=sink.write, args=(batch,))  # as on the recorder's writer thread
            writer.start()
            writer.join()
        sink.close()
        assert wandb.run is run  # a run the sink found stays open
    finally:
        run.finish()
    rows = trackers.wandb_history(trackers.wandb_offline_file(tracker_env["folder"], run.id))
    assert sum("user/loss" in r for r in rows) == 2
    got = trackers.series_from_rows(rows, "train/global_step")
    trackers.assert_same_series(got, trackers.expected_series(recorded["ratios"], offset=1))


def test_mlflow_run_holds_every_step_of_the_run(tracker_env, recorded):
    from upd.sinks.mlflow import MLflow

    client = tracker_env["client"]
    sink = MLflow(run_name="export")
    assert sink.tracking_uri == tracker_env["uri"] and sink.owns_run
    assert export_run_tables(recorded, sink) == STEPS
    assert client.get_run(sink.run_id).info.status == "FINISHED"
    got = trackers.mlflow_histories(client, sink.run_id)
    expected = trackers.expected_series(recorded["ratios"])
    trackers.assert_same_series(got, expected)
    trackers.assert_same_series(got, expected_scalars(recorded["scalars"]))
    shifted = MLflow(run_name="shifted", step_offset=1)  # the comparison catches a shifted step
    export_run_tables(recorded, shifted)
    with pytest.raises(AssertionError, match="steps"):
        trackers.assert_same_series(trackers.mlflow_histories(client, shifted.run_id), expected)


def test_mlflow_sink_writes_from_another_thread_into_the_active_run(tracker_env, recorded):
    """MLflow keeps the active run per thread; the recorder writes on its own: the sink holds the run it found."""
    import mlflow

    from upd.sinks.mlflow import MLflow

    with mlflow.start_run(run_name="user-run") as active:
        mlflow.log_metric("user/loss", 1.0, step=1)
        sink = MLflow()
        assert sink.run_id == active.info.run_id and not sink.owns_run
        writer = threading.Thread(target=sink.write, args=(list(sink_steps(recorded["ratios"], recorded["scalars"])),))
        writer.start()
        writer.join()
        sink.close()
        assert tracker_env["client"].get_run(active.info.run_id).info.status == "RUNNING"
    got = trackers.mlflow_histories(tracker_env["client"], active.info.run_id)
    assert got["user/loss"] == [(1, 1.0)]
    trackers.assert_same_series(got, trackers.expected_series(recorded["ratios"]))


def test_mlflow_keys_are_names_mlflow_accepts(tracker_env):
    from upd.sinks.mlflow import MLflow, mlflow_key

    assert mlflow_key("update_to_data/layers.0.weight") == "update_to_data/layers.0.weight"
    assert mlflow_key("scalars/opt1:loss") == "scalars/opt1:loss"
    assert mlflow_key("update_to_data/w[0]/é") == "update_to_data/w_0__é"
    assert mlflow_key("update_to_data/..") == "update_to_data/__"
    assert mlflow_key("update_to_data/" + "w" * 300) is None
    sink = MLflow(run_name="odd names")
    sink.write([SinkStep(0, 0, 0.0, params={"w[0]": {"update_to_data": -3.0}, "..": {"grad_norm": 1.0}},
                         scalars={"a b": 2.0, "nan": float("nan")})])
    sink.close()
    assert sorted(tracker_env["client"].get_run(sink.run_id).data.metrics) == [
        "grad_norm/__", "scalars/a b", "update_to_data/w_0_"]


def test_analyze_exports_to_wandb_and_mlflow(tracker_env, recorded):
    from upd.cli.main import main

    result = CliRunner().invoke(main, ["analyze", recorded["path"], "--no-plots", "--wandb", "--mlflow"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    wandb_line = next(line for line in lines if line.startswith("W&B: "))
    mlflow_line = next(line for line in lines if line.startswith("MLflow: "))
    assert f"{STEPS} steps in offline run" in wandb_line and f"{STEPS} steps in run" in mlflow_line
    run_id = mlflow_line.split(" in run ", 1)[1].split(" ")[0]
    got = trackers.mlflow_histories(tracker_env["client"], run_id)
    trackers.assert_same_series(got, trackers.expected_series(recorded["ratios"]))
    assert tracker_env["client"].get_run(run_id).info.run_name == "run.h5"
    wandb_id = wandb_line.split("offline run ", 1)[1].split(" ")[0]
    rows = trackers.wandb_history(trackers.wandb_offline_file(tracker_env["folder"], wandb_id))
    trackers.assert_same_series(trackers.series_from_rows(rows, "upd/step"),
                                trackers.expected_series(recorded["ratios"]))


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_package_is_one_message_naming_the_install(tracker, recorded, monkeypatch):
    from upd.cli.main import main
    from upd.sinks.mlflow import MLflow
    from upd.sinks.wandb import WandB

    monkeypatch.setitem(__import__("sys").modules, tracker, None)  # import wandb / mlflow now raises ImportError
    with pytest.raises(ImportError, match=rf'pip install {tracker}, or from a clone of torch-upd: pip install "\.\[{tracker}\]"'):
        {"wandb": WandB, "mlflow": MLflow}[tracker]()
    result = CliRunner().invoke(main, ["analyze", recorded["path"], "--no-plots", f"--{tracker}"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and f'pip install ".[{tracker}]"' in result.output
    assert "Traceback" not in result.output


# -- live, through the recorder's sinks ---------------------------------------------------------------------------
LIVE_STEPS = 70  # more than one of the writer thread's batches (64 steps)


def train_live(path, sinks, steps=LIVE_STEPS, **options):
    """A small real run recorded to `path` with `sinks` (full records every 10th step unless `options` say)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with upd.record(path, model, opt, sinks=sinks, **{"every": 10, **options}) as rec:
        for _ in range(steps):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            rec.log(loss=loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return path


def test_live_sinks_hold_every_step_of_the_run(tracker_env, tmp_path):
    wandb_sink, mlflow_sink = upd.sinks.WandB(name="live"), upd.sinks.MLflow(run_name="live")
    path = train_live(str(tmp_path / "live.h5"), [wandb_sink, mlflow_sink])
    with upd.open_run(path) as run:
        ratios, scalars = run.ratios(), run.scalars()
    assert sorted(set(ratios["step"])) == list(range(LIVE_STEPS))
    expected = trackers.expected_series(ratios)
    rows = trackers.wandb_history(trackers.wandb_offline_file(tracker_env["folder"], wandb_sink.run.id))
    assert len(rows) == LIVE_STEPS  # one log call per step
    for got in (trackers.series_from_rows(rows, "upd/step"),
                trackers.mlflow_histories(tracker_env["client"], mlflow_sink.run_id)):
        trackers.assert_same_series(got, expected, rtol=trackers.LIVE_RTOL)
        trackers.assert_same_series(got, expected_scalars(scalars), rtol=trackers.LIVE_RTOL)


class FailingSink:
    """A sink that raises when it is handed step 3."""

    def __init__(self):
        self.steps, self.closed = [], False

    def write(self, steps):
        for step in steps:
            if step.step == 3:
                raise RuntimeError("the tracker went away at step 3")
            self.steps.append(step.step)

    def close(self):
        self.closed = True


def test_a_failing_sink_warns_once_and_training_the_file_and_the_other_sinks_go_on(tracker_env, tmp_path):
    failing, mlflow_sink = FailingSink(), upd.sinks.MLflow(run_name="beside a failing sink")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = train_live(str(tmp_path / "failing.h5"), [failing, mlflow_sink], steps=12)
    ours = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(ours) == 1 and "step 3" in str(ours[0].message), [str(w.message) for w in ours]
    assert failing.steps == [0, 1, 2]
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    with upd.open_run(path) as run:
        ratios = run.ratios()
        assert list(run.steps()["step"]) == list(range(12))
    trackers.assert_same_series(trackers.mlflow_histories(tracker_env["client"], mlflow_sink.run_id),
                                trackers.expected_series(ratios), rtol=trackers.LIVE_RTOL)


# -- the Trainers' own loggers --------------------------------------------------------------------------------------
HF_STEPS = 4


@pytest.fixture(scope="module")
def hf_trained(tracker_env, tmp_path_factory):
    """One Hugging Face Trainer reporting to wandb (offline), mlflow and tensorboard, with UpdCallback()."""
    transformers = pytest.importorskip("transformers")
    import mlflow

    from upd.integrations.transformers import DEFAULT_FILE, UpdCallback

    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        str(out), use_cpu=True, report_to=["wandb", "mlflow", "tensorboard"], max_steps=HF_STEPS,
        per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_strategy="no", disable_tqdm=True,
        run_name="hf")
    before = {r.info.run_id for r in tracker_env["client"].search_runs(["0"])}
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                   train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
                                   callbacks=[UpdCallback(every=2)])
    trainer.train()
    import wandb
    wandb_run = wandb.run
    wandb_run.finish()
    mlflow_runs = [r for r in tracker_env["client"].search_runs(["0"]) if r.info.run_id not in before]
    assert mlflow.active_run() is None
    with upd.open_run(os.path.join(out, DEFAULT_FILE)) as run:
        ratios = run.ratios()
    tb_callback = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "TensorBoardCallback")
    return {"ratios": ratios, "wandb_id": wandb_run.id, "mlflow_runs": mlflow_runs,
            "tb_dir": tb_callback.logging_dir, "trainer": trainer}


def test_hf_trainer_mlflow_one_run_holds_the_loss_and_the_ratios_on_the_trainers_steps(tracker_env, hf_trained):
    assert len(hf_trained["mlflow_runs"]) == 1  # the Trainer's own run, no second one
    got = trackers.mlflow_histories(tracker_env["client"], hf_trained["mlflow_runs"][0].info.run_id)
    steps = list(range(1, HF_STEPS + 1))  # the Trainer's global_step: steps done
    assert [s for s, _ in got["loss"]] == steps
    expected = trackers.expected_series(hf_trained["ratios"], offset=1)
    assert [s for s, _ in expected["update_to_data/transformer.h.0.attn.c_attn.weight"]] == steps
    trackers.assert_same_series(got, expected, rtol=trackers.LIVE_RTOL)


def test_hf_trainer_wandb_one_run_holds_the_loss_and_the_ratios_on_the_trainers_steps(tracker_env, hf_trained):
    rows = trackers.wandb_history(trackers.wandb_offline_file(tracker_env["folder"], hf_trained["wandb_id"]))
    got = trackers.series_from_rows(rows, "train/global_step")
    steps = list(range(1, HF_STEPS + 1))
    assert [s for s, _ in got["train/loss"]] == steps
    trackers.assert_same_series(got, trackers.expected_series(hf_trained["ratios"], offset=1),
                                rtol=trackers.LIVE_RTOL)


def test_hf_trainer_tensorboard_holds_the_ratios_in_the_trainers_log_dir(hf_trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(hf_trained["tb_dir"], size_guidance={"scalars": 0})
    events.Reload()
    got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert [s for s, _ in got["train/loss"]] == list(range(1, HF_STEPS + 1))
    trackers.assert_same_series(got, trackers.expected_series(hf_trained["ratios"], offset=1), rtol=1e-6)


def test_lightning_mlflow_and_csv_loggers_hold_the_loss_and_the_ratios_on_the_same_steps(tracker_env, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

    from upd.integrations.lightning import UpdCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 6, generator=g),
                                                                        torch.randn(24, 3, generator=g)), batch_size=4)
    mlflow_logger = MLFlowLogger(experiment_name="lightning", tracking_uri=tracker_env["uri"])
    csv_logger = CSVLogger(str(tmp_path))
    path = str(tmp_path / "lightning.h5")
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                         callbacks=[UpdCallback(path, every=1)], log_every_n_steps=1, logger=[mlflow_logger, csv_logger])
    trainer.fit(Tiny(), loader)
    with upd.open_run(path) as run:
        ratios = run.ratios()
    expected = trackers.expected_series(ratios)
    steps = list(range(5))
    got = trackers.mlflow_histories(tracker_env["client"], mlflow_logger.run_id)
    assert [s for s, _ in got["loss"]] == steps  # Lightning's own logging, on the same steps
    trackers.assert_same_series(got, expected, rtol=trackers.LIVE_RTOL)
    table = pd.read_csv(os.path.join(csv_logger.log_dir, "metrics.csv"))
    got = {c: sorted((int(s), float(v)) for s, v in zip(table["step"], table[c]) if v == v)
           for c in table.columns if c != "step"}
    assert [s for s, _ in got["loss"]] == steps
    trackers.assert_same_series(got, expected, rtol=trackers.LIVE_RTOL)


# -- the recipes of docs/integrations.md, as written ------------------------------------------------------------------
def test_the_wandb_recipe_runs_as_written(tracker_env, tmp_path):
    import wandb

    from tests.integrations.test_recipes import BATCHES, check_recorded, run_recipe

    names = run_recipe("Weights & Biases", tmp_path)
    assert wandb.run is None  # the recipe finished its run
    path = str(tmp_path / "runs" / "exp1.h5")
    check_recorded(path, steps=BATCHES, every=5, losses=names["loss_fn"].values)
    with upd.open_run(path) as run:
        ratios = run.ratios()
    found = [os.path.basename(d) for d in os.listdir(os.path.join(tracker_env["folder"], "wandb"))]
    run_id = max((d for d in found if d.startswith("offline-run-")), key=lambda d: os.path.getmtime(
        os.path.join(tracker_env["folder"], "wandb", d))).rsplit("-", 1)[1]
    rows = trackers.wandb_history(trackers.wandb_offline_file(tracker_env["folder"], run_id))
    trackers.assert_same_series(trackers.series_from_rows(rows, "upd/step"), trackers.expected_series(ratios),
                                rtol=trackers.LIVE_RTOL)


def test_the_mlflow_recipe_runs_as_written(tracker_env, tmp_path):
    import mlflow

    from tests.integrations.test_recipes import BATCHES, check_recorded, run_recipe

    before = {r.info.run_id for r in tracker_env["client"].search_runs(["0"])}
    names = run_recipe("MLflow", tmp_path)
    assert mlflow.active_run() is None
    path = str(tmp_path / "runs" / "exp1.h5")
    check_recorded(path, steps=BATCHES, every=5, losses=names["loss_fn"].values)
    with upd.open_run(path) as run:
        ratios = run.ratios()
    new = [r for r in tracker_env["client"].search_runs(["0"]) if r.info.run_id not in before]
    assert len(new) == 1  # the recipe's run, and no second one started by the sink
    trackers.assert_same_series(trackers.mlflow_histories(tracker_env["client"], new[0].info.run_id),
                                trackers.expected_series(ratios), rtol=trackers.LIVE_RTOL)


ZERO_JOB = '''
import sys
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
import upd

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)))
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
g = torch.Generator().manual_seed(dist.get_rank())
with upd.record(sys.argv[1], model, opt, every=None, stats_every=1, strict=True) as rec:
    for _ in range(6):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        rec.log(loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
dist.destroy_process_group()
'''


def test_analyze_exports_a_distributed_job_whole_once(tracker_env, tmp_path):
    """A ZeRO job (each rank records its partition of the optimizer) is sent as one run of whole parameters."""
    from upd.cli.main import main

    from tests.harness.distributed import run_script_job

    script = tmp_path / "zero_job.py"
    script.write_text(ZERO_JOB)
    job = str(tmp_path / "job.h5")
    run_script_job(str(script), job, cwd=str(tmp_path))  # the job, not its launch, is the subject here
    with upd.open_run(job) as run:
        assert run.world_size == 2 and len(run.ranks) == 2
        ratios = run.ratios()
    assert sorted(set(ratios["param"])) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    result = CliRunner().invoke(main, ["analyze", job, "--no-plots", "--mlflow"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("MLflow: "))
    run_id = line.split(" in run ", 1)[1].split(" ")[0]
    trackers.assert_same_series(trackers.mlflow_histories(tracker_env["client"], run_id),
                                trackers.expected_series(ratios))
