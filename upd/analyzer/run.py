"""Reading a run file: lazy, committed-records-only access to what the recorder wrote."""
from __future__ import annotations

import os
from functools import cached_property
from typing import Iterator

import h5py
import numpy as np
import pandas as pd
import torch

from .. import format as fmt


class RunFileError(Exception):
    """The file cannot be used as a torch-upd run. The message is one line naming the file and the problem."""


# Rows read at once when streaming a parameter's history: bounds memory on large runs.
DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise RunFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise RunFileError(f"{path}: is a directory, not a run file")
    if not os.access(path, os.R_OK):
        raise RunFileError(f"{path}: permission denied")
    if os.path.getsize(path) == 0:
        raise RunFileError(f"{path}: empty file, not a run file")


class ParamRecord:
    """One parameter's recorded history inside one optimizer."""

    def __init__(self, optimizer: "OptimizerRun", name: str, group: h5py.Group):
        self.optimizer = optimizer
        self.name = name
        self._group = group
        try:
            self.meta = fmt.from_json(group.attrs[fmt.ATTR_META])
            records = group[fmt.RECORD_INDEX][()]
        except (KeyError, ValueError, OSError) as exc:
            raise RunFileError(f"{optimizer.run.path}: parameter {name!r} is malformed ({exc})") from None
        # Rows whose record was never committed (a crash mid-record) do not exist for readers.
        self.records = records[records < optimizer.num_records]
        self.shape = tuple(self.meta.get("shape") or ())
        self.dtype = self.meta.get("dtype")
        self.param_group = self.meta.get("group")

    @property
    def rows(self) -> int:
        return len(self.records)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def kinds(self) -> list[str]:
        return [k for k in (fmt.KIND_PARAM, fmt.KIND_GRAD, fmt.KIND_PARAM_AFTER) if k in self._group]

    @cached_property
    def state_keys(self) -> list[str]:
        if fmt.STATE_GROUP not in self._group:
            return []
        return list(fmt.from_json(self._group[fmt.STATE_GROUP].attrs.get("keys", "[]")))

    def row_of(self, record: int) -> int | None:
        hits = np.nonzero(self.records == record)[0]
        return int(hits[0]) if len(hits) else None

    def _decode(self, ds: h5py.Dataset, rows) -> torch.Tensor:
        return fmt.numpy_to_tensor(ds[rows], ds.attrs.get("torch_dtype", "float32"))

    def read(self, kind: str, rows=slice(None)) -> torch.Tensor:
        """Tensor of kind ('param', 'grad', 'param_after') at the given row(s); rows index ``self.records``."""
        if kind not in self._group:
            raise KeyError(f"{self.name}: no {kind!r} recorded")
        rows = self._clip(rows)
        return self._decode(self._group[kind], rows)

    def _clip(self, rows):
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.rows)
            return slice(start, stop, step)
        if isinstance(rows, (int, np.integer)):
            if not -self.rows <= rows < self.rows:
                raise IndexError(f"{self.name}: row {rows} out of range ({self.rows} rows)")
            return int(rows) % self.rows
        return rows

    def state_at(self, row: int) -> dict[str, torch.Tensor]:
        """Optimizer state (before the step) at one row: only the keys that were present."""
        keys = self.state_keys
        if not keys:
            return {}
        present_ds = self._group[fmt.STATE_PRESENT]
        present = present_ds[row] if row < present_ds.shape[0] else np.zeros(present_ds.shape[1], "u1")
        out = {}
        for i, key in enumerate(keys):
            if i < len(present) and present[i]:
                out[key] = self._decode(self._group[fmt.STATE_GROUP][key], row)
        return out

    def storage_dtype(self, kind: str = fmt.KIND_PARAM) -> str | None:
        ds = self._group.get(kind)
        return None if ds is None else ds.attrs.get("torch_dtype")

    def block_rows(self, block_bytes: int = DEFAULT_BLOCK_BYTES, kinds: int = 3) -> int:
        per_row = max(1, self.numel * 8 * kinds)  # float64 working copies dominate
        return max(1, block_bytes // per_row)

    def iter_blocks(self, kinds, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[tuple[slice, dict]]:
        """Yield (row slice, {kind: tensor}) over the whole history, a bounded number of rows at a time."""
        step = self.block_rows(block_bytes, max(1, len(kinds)))
        for start in range(0, self.rows, step):
            rows = slice(start, min(start + step, self.rows))
            yield rows, {k: self.read(k, rows) for k in kinds if k in self._group}

    def __repr__(self) -> str:
        return f"<ParamRecord {self.name} {list(self.shape)} {self.rows} rows>"


class OptimizerRun:
    """One recorded optimizer: its committed records and its parameters."""

    def __init__(self, run: "Run", index: int, group: h5py.Group):
        self.run = run
        self.index = index
        self._group = group
        try:
            self.meta = fmt.from_json(group.attrs[fmt.ATTR_META])
            records = group["records"]
            self.num_records = int(records["step"].shape[0])
            self.step = records["step"][()]
            self.backward_pass = records["backward_pass"][: self.num_records]
            self.wall_time = records["wall_time"][: self.num_records]
            self.lr = records["lr"][: self.num_records]
            self._hparams_ds = records["hparams"]
            if min(len(self.backward_pass), len(self.wall_time), len(self.lr),
                   self._hparams_ds.shape[0]) < self.num_records:
                raise ValueError("record table columns are shorter than the committed steps")
        except (KeyError, ValueError, OSError, TypeError) as exc:
            raise RunFileError(f"{run.path}: optimizer {index} is malformed ({exc})") from None
        self.class_name = self.meta.get("class", "?")
        records = [ParamRecord(self, name, pgroup) for name, pgroup in group["params"].items()]
        # HDF5 lists names alphabetically (layers.10 before layers.3); show them in the optimizer's order.
        records.sort(key=lambda p: (p.param_group or 0, p.meta.get("index_in_group") or 0))
        self.params: dict[str, ParamRecord] = {p.name: p for p in records}

    def hparams(self, record: int) -> list[dict]:
        """The param groups' hyperparameters at one record, as the optimizer saw them (JSON-decoded)."""
        if not 0 <= record < self.num_records:
            raise IndexError(f"record {record} out of range ({self.num_records} records)")
        return fmt.from_json(self._hparams_ds[record])

    def closure_losses(self, record: int) -> list | None:
        """Losses of each closure evaluation inside the step (LBFGS & co.), or None for a step without closure."""
        if "closure_losses" not in self._group["records"]:
            return None
        ds = self._group["records"]["closure_losses"]
        return fmt.from_json(ds[record]) if record < ds.shape[0] else None

    def record_of_step(self, step: int) -> int | None:
        hits = np.nonzero(self.step == step)[0]
        return int(hits[0]) if len(hits) else None

    def __repr__(self) -> str:
        return f"<OptimizerRun {self.index} {self.class_name}: {len(self.params)} params, {self.num_records} records>"


class Run:
    """A recorded run. ``upd.open_run(path)`` opens one; use it as a context manager or call ``close()``."""

    def __init__(self, path):
        self.path = os.fspath(path)
        _check_path(self.path)
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as exc:
            raise RunFileError(f"{self.path}: not a readable HDF5 file ({str(exc).splitlines()[0]})") from None
        try:
            self._load()
        except RunFileError:
            self.close()
            raise
        except Exception as exc:  # a file that h5py opens can still be broken anywhere inside
            self.close()
            raise RunFileError(f"{self.path}: unreadable run ({type(exc).__name__}: {exc})") from None

    def _load(self) -> None:
        attrs = self._file.attrs
        fmt_name = attrs.get(fmt.ATTR_FORMAT)
        if isinstance(fmt_name, bytes):
            fmt_name = fmt_name.decode("utf-8", "replace")
        if fmt_name != fmt.FORMAT_NAME:
            raise RunFileError(f"{self.path}: HDF5 file but not a torch-upd run (no '{fmt.ATTR_FORMAT}' attribute "
                               f"saying {fmt.FORMAT_NAME!r})")
        version = attrs.get(fmt.ATTR_VERSION)
        if not isinstance(version, (int, np.integer)):
            raise RunFileError(f"{self.path}: format_version attribute missing or not an integer")
        if version > fmt.FORMAT_VERSION:
            raise RunFileError(f"{self.path}: written in run format version {int(version)}; this torch-upd reads "
                               f"up to version {fmt.FORMAT_VERSION}: upgrade torch-upd")
        self.format_version = int(version)
        try:
            self.meta = fmt.from_json(attrs[fmt.ATTR_META])
        except (KeyError, ValueError) as exc:
            raise RunFileError(f"{self.path}: run metadata missing or not valid JSON ({exc})") from None
        if "optimizers" not in self._file:
            raise RunFileError(f"{self.path}: no 'optimizers' group")
        groups = self._file["optimizers"]
        self.optimizers = [OptimizerRun(self, int(k), groups[k]) for k in sorted(groups, key=int)]
        raw = attrs.get("params_not_optimized")
        self.params_not_optimized = fmt.from_json(raw) if raw is not None else []

    # -- overview ---------------------------------------------------------------------------------------------
    @property
    def torch_version(self) -> str:
        return self.meta.get("torch_version", "?")

    @property
    def options(self) -> dict:
        return self.meta.get("options", {})

    def param(self, name: str, optimizer: int | None = None) -> ParamRecord:
        for opt in self.optimizers:
            if (optimizer is None or opt.index == optimizer) and name in opt.params:
                return opt.params[name]
        raise KeyError(f"{self.path}: no parameter {name!r}")

    def iter_params(self) -> Iterator[ParamRecord]:
        for opt in self.optimizers:
            yield from opt.params.values()

    @property
    def params(self) -> pd.DataFrame:
        """One row per recorded parameter: optimizer, param, shape, numel, dtype, group, rows, kinds, state."""
        from .stats import stats_param_meta

        rows = [{"optimizer": p.optimizer.index, "param": p.name, "shape": p.shape, "numel": p.numel,
                 "dtype": p.dtype, "group": p.param_group, "rows": p.rows,
                 "kinds": ",".join(p.kinds), "state": ",".join(p.state_keys)}
                for p in self.iter_params()]
        for opt in self.optimizers:  # parameters that only have per-step statistics
            for name, meta in stats_param_meta(opt).items():
                if name not in opt.params:
                    shape = tuple(meta.get("shape") or ())
                    rows.append({"optimizer": opt.index, "param": name, "shape": shape,
                                 "numel": int(np.prod(shape)) if shape else 1, "dtype": meta.get("dtype"),
                                 "group": meta.get("group"), "rows": 0, "kinds": "", "state": ""})
        return pd.DataFrame(rows, columns=["optimizer", "param", "shape", "numel", "dtype", "group", "rows",
                                           "kinds", "state"])

    @property
    def steps(self) -> pd.DataFrame:
        """One row per committed record: optimizer, record, step, backward_pass, wall_time, lr per param group."""
        frames = []
        for opt in self.optimizers:
            df = pd.DataFrame({"optimizer": opt.index, "record": np.arange(opt.num_records), "step": opt.step,
                               "backward_pass": opt.backward_pass, "wall_time": opt.wall_time})
            for g in range(opt.lr.shape[1] if opt.lr.ndim == 2 else 0):
                df[f"lr_group{g}"] = opt.lr[:, g]
            frames.append(df)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
            columns=["optimizer", "record", "step", "backward_pass", "wall_time"])

    @property
    def size_bytes(self) -> int:
        return os.path.getsize(self.path)

    def describe(self) -> dict:
        """What the file holds, as plain data (what `upd info` prints)."""
        from .stats import committed_stats_rows, stats_param_meta

        optimizers = []
        for opt in self.optimizers:
            steps = opt.step
            optimizers.append({
                "index": opt.index, "class": opt.class_name, "records": opt.num_records,
                "stats_steps": committed_stats_rows(opt),
                "first_step": int(steps[0]) if len(steps) else None,
                "last_step": int(steps[-1]) if len(steps) else None,
                "param_groups": int(opt.lr.shape[1]) if opt.lr.ndim == 2 else 0,
                "defaults": opt.meta.get("defaults", {}),
                "params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "group": p.param_group,
                            "rows": p.rows, "kinds": p.kinds, "state": p.state_keys,
                            "stored_as": p.storage_dtype()} for p in opt.params.values()]
                + [{"name": name, "shape": list(meta.get("shape") or []), "dtype": meta.get("dtype"),
                    "group": meta.get("group"), "rows": 0, "kinds": [], "state": [], "stored_as": None}
                   for name, meta in stats_param_meta(opt).items() if name not in opt.params],
            })
        return {"path": self.path, "size_bytes": self.size_bytes, "format_version": self.format_version,
                "torch_version": self.torch_version, "upd_version": self.meta.get("upd_version"),
                "created_unix": self.meta.get("created_unix"), "options": self.options,
                "params_not_optimized": self.params_not_optimized, "optimizers": optimizers}

    # -- analysis ---------------------------------------------------------------------------------------------
    def ratios(self, block_bytes: int = DEFAULT_BLOCK_BYTES, source: str = "auto") -> pd.DataFrame:
        """Tidy DataFrame, one row per (optimizer, param, step): update:data and grad:data ratios and norms.

        update_to_data = log10(std(param_after - param) / std(param)) and grad_to_data = log10(std(grad) /
        std(param)), std as torch.std (unbiased), exactly as the seed question's loop.

        source: "tensors" computes them from the full tensors (streamed in bounded blocks: a large run is never
        loaded whole); "stats" reads the per-step statistics table; "auto" (default) uses, per optimizer, whichever
        covers more steps (statistics every step beat full tensors every 500th).
        """
        from .ratios import ratios_frame
        from .stats import committed_stats_rows, ratios_from_stats, stats_frame

        if source not in ("auto", "tensors", "stats"):
            raise ValueError(f"source must be 'auto', 'tensors' or 'stats', got {source!r}")
        use_stats = {opt.index for opt in self.optimizers if committed_stats_rows(opt) and (
            source == "stats" or (source == "auto" and committed_stats_rows(opt) > opt.num_records))}
        parts = []
        if len(use_stats) < len(self.optimizers):
            tensors = ratios_frame(self, block_bytes)
            parts.append(tensors[~tensors["optimizer"].isin(use_stats)])
        if use_stats:
            stats = stats_frame(self)
            numel = {(r.optimizer, r.param): r.numel for r in self.params.itertuples()}
            parts.append(ratios_from_stats(stats[stats["optimizer"].isin(use_stats)], numel))
        parts = [p for p in parts if len(p)]
        return pd.concat(parts, ignore_index=True) if parts else ratios_frame(self, block_bytes)

    def stats(self) -> pd.DataFrame:
        """The per-step statistics table (recorded with stats_every=): one row per (optimizer, param, step) with
        mean, std, norm, absmax, zero_frac, nonfinite of param, grad, update and each optimizer-state tensor."""
        from .stats import stats_frame

        return stats_frame(self)

    def close(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None and f.id.valid:
            f.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<upd.Run {self.path!r}: " + ", ".join(repr(o) for o in self.optimizers) + ">"


def open_run(path) -> Run:
    """Open a recorded run for reading. Raises RunFileError (one clear line) for anything that is not a usable run."""
    return Run(path)

