"""Reading back what the trackers hold, through their own formats and APIs: a W&B offline run's history rows (its
``.wandb`` file, records decoded by wandb's own protobuf classes), an MLflow run's metric histories
(``MlflowClient.get_metric_history``), and the ratios table of a torch-upd run in the same shape, to compare them.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time

import numpy as np

from upd.sinks.base import LIVE_COLUMNS

# The .wandb file is a LevelDB-style log: a 7-byte file header (":W&B", magic, version), then records in 32 KiB
# blocks, each record a 7-byte header (checksum, length, type) and its bytes, a record split over blocks as
# FIRST, MIDDLE..., LAST parts; a block's tail shorter than a header is padding.
_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: str):
    """The protobuf Records of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, parts = _HEADER, []
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:
            pos += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if length == 0 and kind == 0:  # the block's zero padding
            pos += room
            continue
        if pos + _HEADER + length > len(data):  # a record still being written
            break
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        parts.append(chunk)
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_offline_file(wandb_dir: str, run_id: str) -> str:
    """The .wandb file of offline run `run_id` under `wandb_dir` (wandb.init's dir=)."""
    found = glob.glob(os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))
    assert len(found) == 1, (wandb_dir, run_id, found)
    return found[0]


def wandb_history(path: str, timeout: float = 30.0) -> list[dict]:
    """The history rows (one per ``run.log`` commit) of a finished run's .wandb file: {key: value}, with W&B's own
    ``_step``. wandb-core writes the file in its own process and may still be writing when ``finish()`` has
    returned: read once its last record, the run's exit, is there."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def mlflow_histories(client, run_id: str) -> dict[str, list]:
    """{metric name: [(step, value), ...] in step order} of an MLflow run."""
    names = client.get_run(run_id).data.metrics
    return {name: sorted((m.step, m.value) for m in client.get_metric_history(run_id, name)) for name in names}


def expected_series(ratios, offset: int = 0, columns=LIVE_COLUMNS, prefix_of=lambda k: f"opt{k}:" if k else "") \
        -> dict[str, list]:
    """{tag: [(step + offset, value), ...]} of a ratios table: what a sink must have delivered, finite values only."""
    out: dict[str, list] = {}
    for column in columns:
        for (optimizer, param), rows in ratios.groupby(["optimizer", "param"], sort=False):
            pairs = [(int(s) + offset, float(v)) for s, v in zip(rows["step"], rows[column]) if np.isfinite(v)]
            if pairs:
                out[f"{column}/{prefix_of(int(optimizer))}{param}"] = sorted(pairs)
    return out


def series_from_rows(rows: list[dict], step_key: str) -> dict[str, list]:
    """{tag: [(row[step_key], value), ...]} from W&B history rows, for every key but the step keys."""
    out: dict[str, list] = {}
    for row in rows:
        if step_key not in row:
            continue
        for key, value in row.items():
            if key != step_key and not key.startswith("_") and isinstance(value, (int, float)):
                out.setdefault(key, []).append((int(row[step_key]), float(value)))
    return {k: sorted(v) for k, v in out.items()}


# Live values are the recorder's float64 statistics; the run file keeps float32 ones, from which ratios() recomputes.
LIVE_RTOL = 1e-6


def assert_same_series(got: dict, expected: dict, tags=None, rtol=1e-12) -> None:
    """Every expected tag's steps equal, and its values equal to `rtol` (an export sends the file's values: equal to
    the bit by default; live values against the file: LIVE_RTOL)."""
    for tag in (tags if tags is not None else expected):
        assert tag in got, f"{tag} missing; the tracker has {sorted(got)[:8]}..."
        steps = [s for s, _ in got[tag]]
        assert steps == [s for s, _ in expected[tag]], f"{tag}: steps {steps} != {[s for s, _ in expected[tag]]}"
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in expected[tag]], rtol=rtol, err_msg=tag)
