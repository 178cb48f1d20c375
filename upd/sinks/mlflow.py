"""MLflow: a recording's statistics, live, in the active MLflow run (or one it starts).

    mlflow.start_run()                                                   # optional: the run to write into
    upd.record("run.h5", model, optimizer, sinks=[upd.sinks.MLflow()])  # the active run, else a new one

The tags are ``upd.sinks.base.metrics``'s (``update_to_data/<param>``, ..., ``scalars/<name>``), at MLflow's own
``step`` (the recorder's step, plus ``step_offset``), each batch of steps in as few ``log_batch`` calls as MLflow's
limit of 1000 metrics per call allows. The run is found on the thread that makes the sink: MLflow keeps the active
run per thread, and the recorder writes on its own thread, so the sink holds the run's id and a client of its own.

Where: the tracking URI the user set (``tracking_uri=``, ``mlflow.set_tracking_uri``, ``MLFLOW_TRACKING_URI``),
else a local database, ``sqlite:///mlflow.db`` in the working directory: MLflow 3's file store refuses writes unless
``MLFLOW_ALLOW_FILE_STORE=true``, so it is never chosen here. mlflow is imported when a sink is made.
"""
from __future__ import annotations

import os
import re
import time
from typing import Sequence

from .base import SinkStep, metrics

DEFAULT_DATABASE = "mlflow.db"  # in the working directory, as MLflow's own default database
INSTALL_HINT = 'pip install mlflow, or from a clone of torch-upd: pip install ".[mlflow]"'
MAX_METRICS_PER_CALL = 1000  # MLflow's log_batch limit
MAX_KEY_LENGTH = 250  # MLflow's limit on a metric's name
_NOT_IN_A_KEY = re.compile(r"[^/\w.\- :]")  # MLflow accepts slashes, word characters, . - space and :


def import_mlflow():
    """The mlflow module, or one ImportError that says how to install it."""
    try:
        import mlflow
    except ImportError as exc:
        raise ImportError(f"the MLflow sink needs the mlflow package, which is not installed or not usable ({exc}): "
                          f"{INSTALL_HINT}") from exc
    return mlflow


def mlflow_key(tag: str) -> str | None:
    """A tag as an MLflow metric name: characters MLflow refuses become "_", and a name segment that would read as
    a path ("." or "..") is spelt with "_"; None when the result is still too long for MLflow."""
    section, _, name = tag.partition("/")
    name = _NOT_IN_A_KEY.sub("_", name.replace("/", "_"))
    if not name.strip("."):
        name = name.replace(".", "_") or "_"
    key = f"{section}/{name}"
    return key if len(key) <= MAX_KEY_LENGTH else None


def user_tracking_uri() -> str | None:
    """The tracking URI the user chose, or None: ``mlflow.set_tracking_uri`` also sets MLFLOW_TRACKING_URI."""
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def local_database() -> str:
    """``sqlite:///mlflow.db`` in the working directory, spelt absolute so that it names one file wherever it is
    read from."""
    return "sqlite:///" + os.path.abspath(DEFAULT_DATABASE)


class MLflow:
    """A live sink into an MLflow run.

    Args:
        run_id: the run to write into; default the active run of the thread making the sink, else a new run
            (``experiment``: its experiment's name, created if missing, default MLflow's default experiment;
            ``run_name``), ended by ``close()``. A run given or found is left open.
        tracking_uri: default the user's (see the module's docstring), else ``sqlite:///mlflow.db``.
        step_offset: added to the recorder's step to give MLflow's step.
        every: write the steps whose MLflow step is a multiple of this (default 1: all). MLflow's sqlite store
            costs about 0.1 ms of CPU per metric (its ORM), 5 per parameter per step: for a model of many tensors
            and short steps, a few hundred points per curve are what its charts show anyway.
    """

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None, experiment: str | None = None,
                 run_name: str | None = None, step_offset: int = 0, every: int = 1):
        mlflow = import_mlflow()
        from mlflow.tracking import MlflowClient

        if run_id is None and (active := mlflow.active_run()) is not None:
            run_id = active.info.run_id
            tracking_uri = tracking_uri or mlflow.get_tracking_uri()  # the URI the active run was started with
        self.tracking_uri = tracking_uri or user_tracking_uri() or local_database()
        self.client = MlflowClient(self.tracking_uri)
        self.owns_run = run_id is None
        if run_id is None:
            run_id = self.client.create_run(self._experiment_id(experiment), run_name=run_name).info.run_id
        self.run_id = run_id
        self.step_offset = int(step_offset)
        if int(every) < 1:
            raise ValueError(f"MLflow: every must be a positive number of steps, not {every!r}")
        self.every = int(every)
        self.closed = False
        self._keys: dict[str, str | None] = {}  # tag -> MLflow name, made once per tag

    def _experiment_id(self, name: str | None) -> str:
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's default experiment, in every store
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def _key(self, tag: str) -> str | None:
        key = self._keys.get(tag, "")
        if key == "":
            key = self._keys[tag] = mlflow_key(tag)
        return key

    def write(self, steps: Sequence[SinkStep]) -> None:
        """The batch's metrics, in ``log_batch`` calls of at most 1000 metrics, in step order."""
        if self.closed:
            raise ValueError("the MLflow sink is closed")
        from mlflow.entities import Metric

        batch: list = []
        now = int(time.time() * 1000)
        for step in steps:
            timestamp = int(step.wall_time * 1000) if step.wall_time > 0 else now
            at = step.step + self.step_offset
            if at % self.every:
                continue
            for tag, value in metrics(step).items():
                key = self._key(tag)
                if key is not None:
                    batch.append(Metric(key, value, timestamp, at))
        for start in range(0, len(batch), MAX_METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=batch[start:start + MAX_METRICS_PER_CALL])

    def close(self) -> None:
        """End the run if this sink started it; a run given or found stays open. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.owns_run:
            self.client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"<upd.sinks.MLflow run {self.run_id} at {self.tracking_uri}{' (closed)' if self.closed else ''}>"
