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
    path = str(tmp_path_factory.mktemp("run") / "run.h5")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with upd.record(path, model, opt, every=5, stats_every=1) as rec:
        for _ in range(STEPS):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            rec.log(loss=loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
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
