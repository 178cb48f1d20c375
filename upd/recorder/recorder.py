"""The recorder: attaches to optimizers through torch's step pre/post hooks and writes what each step did."""
from __future__ import annotations

import atexit
import collections
import dataclasses
import fnmatch
import math
import os
import platform
import signal
import statistics
import sys
import threading
import time
import warnings
import weakref
from typing import Sequence

import torch

from .. import __version__
from ..runfile import encoding, schema
from ..ratios import GRAD_TO_DATA, UPDATE_TO_DATA, grad_to_data, update_to_data
from .device_stats import SPARSE_LAYOUTS, STATS, count_nonfinite, stats_rows, to_host
from ..integrations.tensorboard import TensorBoardSink
from ..runfile.async_writer import AsyncRunWriter
from ..runfile.writer import ParamSnapshot, RecordSnapshot, RunWriter  # noqa: F401  (tests swap RunWriter)


class RecorderWarning(UserWarning):
    """The recorder stopped recording; training goes on."""


# Recorders still open, closed at interpreter exit and on SIGTERM so their files end cleanly.
_LIVE: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
_HANDLERS_INSTALLED = False


_PENDING_SIGNAL: list = []  # a SIGTERM that arrived while a recorder was inside its hook


def _close_all_live() -> None:
    for rec in list(_LIVE):
        try:
            rec.close()
        except Exception:
            pass


def _install_exit_handlers() -> None:
    """Close open runs at exit and on SIGTERM, then let the signal do what it did before (the user's handler, or
    the default: terminate). Installed once, and only from the main thread (signal handlers can only be set there)."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_close_all_live)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        # Arriving in the middle of a recorder's hook (inside an HDF5 write), closing the file under that frame
        # could corrupt it: the hook finishes first (milliseconds), then the signal is handled.
        if any(rec._busy for rec in list(_LIVE)):
            _PENDING_SIGNAL.append((signum, frame))
            return
        finish(signum, frame)

    def finish(signum, frame):
        _close_all_live()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # default action: terminate, as if we had never been here
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    global _FINISH_SIGNAL
    _FINISH_SIGNAL = finish
    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        pass


_FINISH_SIGNAL = None


def _group_hparams(group: dict) -> dict:
    return {k: encoding.jsonable(v) for k, v in group.items() if k not in ("params", "param_names")}


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse gradient, parameter or state tensor as the dense tensor the run stores (no copy when dense)."""
    return tensor.to_dense() if tensor.layout in SPARSE_LAYOUTS else tensor


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    tensor = _dense(tensor.detach())
    # .to(..., copy=True) always copies, so the snapshot cannot alias memory the optimizer updates in place.
    return tensor.to("cpu", copy=True)


def _dtensor_class():
    """torch.distributed.tensor.DTensor when that module is loaded (no DTensor can exist otherwise), else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _refuse_dtensor(dtensor_class, tensor, what: str) -> None:
    """Stop recording at the first DTensor: its local shard is not the tensor the optimizer updates, and a gathered
    copy would be a collective inside the optimizer's step (distributed recording is not supported yet)."""
    if dtensor_class is not None and isinstance(tensor, dtensor_class):
        placements = ", ".join(str(pl) for pl in getattr(tensor, "placements", ()))
        raise TypeError(f"{what} is a DTensor (torch.distributed.tensor, placements [{placements}]); torch-upd "
                        "does not record distributed tensors yet")


def _initial_step(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer already took (a resumed run), from its per-parameter 'step' state when it keeps one."""
    steps = [int(s["step"]) for s in optimizer.state.values() if isinstance(s.get("step"), (int, float, torch.Tensor))
             and (not isinstance(s.get("step"), torch.Tensor) or s["step"].numel() == 1)]
    return max(steps, default=0)


class Recorder:
    """Records param groups, parameters before/after, gradients and optimizer state at each optimizer step.

    Use ``upd.record(...)`` to make one. See its docstring for the options.
    """

    def __init__(self, path, model=None, optimizer=None, *, every: int | None = 1, stats_every: int | None = None,
                 include=None, exclude=None, what: Sequence[str] = schema.WHAT_CHOICES, dtype: str = "keep",
                 compression=None, tensorboard=None, zero_counts: Sequence[str] = ("grad",),
                 flight_recorder: int | None = None,
                 spike_factor: float = 10.0, overwrite: bool = False, resume: bool = False, strict: bool = False):
        if optimizer is None:
            raise TypeError("upd.record needs the optimizer (or a list of optimizers) to watch")
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"expected a torch.optim.Optimizer, got {type(opt).__name__}")
        for label, cadence in (("every", every), ("stats_every", stats_every)):
            if cadence is not None and (not isinstance(cadence, int) or isinstance(cadence, bool) or cadence < 1):
                raise ValueError(f"{label} must be a positive integer or None, got {cadence!r}")
        if tensorboard is not None and stats_every is None:
            stats_every = 1  # TensorBoard scalars come from the statistics: log them at every step
        if flight_recorder is not None and (not isinstance(flight_recorder, int) or flight_recorder < 1):
            raise ValueError(f"flight_recorder must be a positive number of steps or None, got {flight_recorder!r}")
        if not spike_factor > 1:
            raise ValueError(f"spike_factor must be > 1, got {spike_factor!r}")
        if every is None and stats_every is None and flight_recorder is None:
            raise ValueError("every=None and stats_every=None would record nothing")
        what = (what,) if isinstance(what, str) else tuple(what)
        unknown = set(what) - set(schema.WHAT_CHOICES)
        if unknown:
            raise ValueError(f"what= accepts {schema.WHAT_CHOICES}, got {sorted(unknown)}")
        if dtype not in schema.STORAGE_DTYPES:
            raise ValueError(f"dtype= must be one of {schema.STORAGE_DTYPES}, got {dtype!r}")
        if compression not in (None, "gzip", "lzf"):
            raise ValueError(f"compression= must be None, 'gzip' or 'lzf', got {compression!r}")

        self.path = os.fspath(path)
        self.optimizers = optimizers
        self.every = every
        self.stats_every = stats_every
        zero_counts = (zero_counts,) if isinstance(zero_counts, str) else tuple(zero_counts)
        if set(zero_counts) - {"param", "grad", "update", "state"}:
            raise ValueError(f"zero_counts= takes 'param', 'grad', 'update', 'state'; got {zero_counts!r}")
        self.zero_counts = zero_counts
        self.flight_recorder = flight_recorder
        self.spike_factor = spike_factor
        # Flight recorder: the last K steps' full snapshots per optimizer, in memory, written only on a trigger.
        self._ring = [collections.deque(maxlen=flight_recorder or 1) for _ in optimizers]
        self._norm_history = [collections.deque(maxlen=50) for _ in optimizers]  # (grad norm, update norm)
        self._written_steps = [collections.deque(maxlen=max(64, 2 * (flight_recorder or 1))) for _ in optimizers]
        self.dumps: list[dict] = []
        self._tensorboard = None
        if tensorboard is not None:
            self._tensorboard = TensorBoardSink(tensorboard)
        self.include = [include] if isinstance(include, str) else list(include or [])
        self.exclude = [exclude] if isinstance(exclude, str) else list(exclude or [])
        self.what = what
        self.strict = strict
        self.active = False
        self._busy = False  # inside one of our hooks (signal handlers must not close the file then)
        self.error: BaseException | None = None

        self._model_names = {}
        if model is not None:
            # named_parameters() already drops duplicates: a tied parameter is recorded once, under its first name.
            self._model_names = {id(p): n for n, p in model.named_parameters()}
        self._handles = []
        self._pending: dict[int, RecordSnapshot] = {}
        self._steps_done = [_initial_step(opt) for opt in optimizers]
        self._records = [0] * len(optimizers)
        self._backward_counts: dict[int, int] = {}
        self._hooked_params: set[int] = set()
        self._names: list[dict[int, str]] = [dict() for _ in optimizers]
        self._layouts: dict[int, tuple] = {}  # parameter ids when names were last assigned

        meta = {
            "upd_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "created_unix": time.time(),
            "argv": list(sys.argv),
            "options": {"every": every, "stats_every": stats_every, "zero_counts": list(zero_counts),
                        "flight_recorder": flight_recorder,
                        "spike_factor": spike_factor, "include": self.include, "exclude": self.exclude, "what": list(what),
                        "dtype": dtype, "compression": compression},
            "optimizer_count": len(optimizers),
        }
        if overwrite and resume:
            raise ValueError("pass overwrite=True or resume=True, not both")
        # HDF5 writes happen on a writer thread behind a queue of 2 records: training waits only when the disk is
        # slower than training (../shared/notes: +5% instead of +24% inline).
        try:
            self._writer = AsyncRunWriter(self.path, meta, overwrite=overwrite, storage_dtype=dtype,
                                          compression=compression, resume=resume, max_pending=2)
        except FileExistsError:
            raise  # refusing to overwrite is the answer the user asked for
        except OSError as exc:  # permission denied, read-only or full filesystem: never stop the training
            self.error = exc
            if strict:
                raise
            warnings.warn(f"torch-upd: cannot record to {self.path} ({type(exc).__name__}: {exc}); training "
                          "continues without recording. Pass strict=True to raise instead.", RecorderWarning,
                          stacklevel=3)
            return
        try:
            for i, opt in enumerate(optimizers):
                opt_meta = {
                    "class": encoding.class_path(type(opt)),
                    "mro": [encoding.defining_path(c) for c in type(opt).__mro__ if issubclass(c, torch.optim.Optimizer)],
                    "defaults": encoding.jsonable({k: v for k, v in opt.defaults.items() if k != "params"}),
                    "initial_step": self._steps_done[i],
                    "params": self._param_layout(i, opt),
                }
                if resume:
                    self._check_resume(i, opt, opt_meta)
                self._writer.add_optimizer(i, opt_meta)
                self._handles.append(opt.register_step_pre_hook(self._make_pre_hook(i)))
                self._handles.append(opt.register_step_post_hook(self._make_post_hook(i)))
            for opt in optimizers:
                # Count from the very first backward pass: before the first step, accumulation and skipped steps
                # would otherwise be invisible.
                for group in opt.param_groups:
                    for p in group["params"]:
                        self._hook_backward_counter(p)
            if model is not None:
                optimized = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
                self._writer.set_attr("params_not_optimized",
                                      [n for n, p in model.named_parameters() if id(p) not in optimized])
        except BaseException:
            self._remove_hooks()
            self._writer.close()
            raise
        self.active = True
        _LIVE.add(self)
        _install_exit_handlers()

    def _param_layout(self, opt_index: int, opt) -> list:
        """Name, shape and group of every parameter the optimizer holds now (resume compares against it)."""
        return [{"name": self._param_name(opt_index, g, i, p, group), "shape": list(p.shape), "group": g}
                for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])]

    def _check_resume(self, index: int, opt, opt_meta: dict) -> None:
        stored = self._writer.optimizer_meta(index)
        if stored is None:
            return  # an optimizer the earlier run did not have: recorded from now on
        problems = []
        if stored.get("class") != opt_meta["class"]:
            problems.append(f"optimizer {index} was {stored.get('class')}, now {opt_meta['class']}")
        before = {p["name"]: p["shape"] for p in stored.get("params", [])}
        now = {p["name"]: p["shape"] for p in opt_meta["params"]}
        if stored.get("params") is not None:
            missing, added = sorted(set(before) - set(now)), sorted(set(now) - set(before))
            if missing:
                problems.append(f"parameters no longer in optimizer {index}: {', '.join(missing)}")
            if added:
                problems.append(f"parameters new in optimizer {index}: {', '.join(added)}")
            reshaped = [f"{n} {before[n]} -> {now[n]}" for n in sorted(set(before) & set(now)) if before[n] != now[n]]
            if reshaped:
                problems.append(f"shapes changed: {'; '.join(reshaped)}")
        if problems:
            self._writer.close()
            raise ValueError(f"{self.path}: cannot resume into this run: " + "; ".join(problems)
                             + ". Record to a new file instead.")
        if not any(isinstance(s.get("step"), torch.Tensor) for s in opt.state.values()):
            # No step counter in the optimizer's state (plain SGD): continue after the last recorded step.
            last = self._writer.last_step(index)
            if last is not None:
                self._steps_done[index] = max(self._steps_done[index], last + 1)

    # -- naming and selection ---------------------------------------------------------------------------------
    def _param_name(self, opt_index: int, group_index: int, index_in_group: int, param, group: dict) -> str:
        names = self._names[opt_index]
        if id(param) in names:
            return names[id(param)]
        name = self._model_names.get(id(param))
        if name is None and "param_names" in group and index_in_group < len(group["param_names"]):
            name = group["param_names"][index_in_group]
        if name is None:
            name = f"group{group_index}.param{index_in_group}"
        # '/' separates HDF5 path components, so it cannot appear in a dataset name.
        name = name.replace("/", "|")
        if name in names.values():
            name = f"{name}#{len(names)}"
        names[id(param)] = name
        return name

    def _selected(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, pat) for pat in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude)

    # -- backward-pass counting -------------------------------------------------------------------------------
    def _hook_backward_counter(self, param: torch.Tensor) -> None:
        # Counting backward passes per parameter shows gradient accumulation and steps skipped by GradScaler
        # (backward passes that were followed by no optimizer step), which the optimizer's own counters cannot.
        if id(param) in self._hooked_params or not param.requires_grad or not param.is_leaf:
            return
        key = id(param)
        self._hooked_params.add(key)
        self._backward_counts[key] = 0

        def count(_param, key=key):
            self._backward_counts[key] += 1

        self._handles.append(param.register_post_accumulate_grad_hook(count))

    # -- hooks ------------------------------------------------------------------------------------------------
    def _make_pre_hook(self, opt_index: int):
        def pre_hook(optimizer, args, kwargs):
            if not self.active:
                return None
            # args is (optimizer, *step_args): a closure is step's first positional argument or `closure=`.
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
            self._guard(self._before_step, opt_index, optimizer, closure is not None)
            rec = self._pending.get(opt_index)
            if closure is None or rec is None or not self.active:
                return None
            wrapped = self._wrap_closure(rec, optimizer, closure)
            if len(args) > 1:
                return (args[0], wrapped, *args[2:]), kwargs
            return args, dict(kwargs, closure=wrapped)
        return pre_hook

    def _wrap_closure(self, rec: RecordSnapshot, optimizer, closure):
        """Closure-driven optimizers (LBFGS) compute the gradient inside step(): capture the gradient of the first
        evaluation (at the parameters before the step) and every evaluation's loss."""
        params = {id(p): p for group in optimizer.param_groups for p in group["params"]}

        def recording_closure(*args, **kwargs):
            loss = closure(*args, **kwargs)
            if self.active:
                self._guard(self._closure_evaluated, rec, params, loss)
            return loss
        return recording_closure

    def _closure_evaluated(self, rec: RecordSnapshot, params: dict, loss) -> None:
        first = not rec.closure_losses
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        rec.closure_losses.append(float(value) if value is not None else float("nan"))
        if first and "grad" in self.what:
            for snap in rec.params:
                p = params.get(snap.param_id)
                if p is not None and p.grad is not None:
                    snap.grad = _cpu_copy(p.grad)

    def _make_post_hook(self, opt_index: int):
        def post_hook(optimizer, args, kwargs):
            if self.active:
                self._guard(self._after_step, opt_index, optimizer)
        return post_hook

    def _guard(self, fn, *args) -> None:
        self._busy = True
        try:
            fn(*args)
        except Exception as exc:  # never take training down with the recorder
            self._fail(exc)
        finally:
            self._busy = False
            if _PENDING_SIGNAL and _FINISH_SIGNAL is not None:
                _FINISH_SIGNAL(*_PENDING_SIGNAL.pop())

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.active = False
        self._pending.clear()
        for ring in self._ring:
            ring.clear()
        # The hooks stay registered (inactive) until close(): removing them here, while torch iterates over the
        # optimizer's hook dict, would raise "OrderedDict mutated during iteration" into the training loop.
        self._writer.abort()
        if self.strict:
            raise exc
        # The traceback holds the writer's frames and their HDF5 objects; freed after the file is gone, those
        # objects make HDF5 try to write again at exit (and crash the process on a full disk).
        exc.__traceback__ = None
        exc.__context__ = None
        warnings.warn(f"torch-upd: recording to {self.path} stopped ({type(exc).__name__}: {exc}); "
                      "training continues. Pass strict=True to raise instead.", RecorderWarning, stacklevel=4)

    def _before_step(self, opt_index: int, optimizer: torch.optim.Optimizer, closure_step: bool = False) -> None:
        self._pending.pop(opt_index, None)  # a step that raised never reached its post-hook
        step = self._steps_done[opt_index]
        # Names and backward counters only change when parameters do (add_param_group, a swapped tensor): a tuple
        # of ids is far cheaper than naming and hooking every parameter again at every step.
        layout = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
        dtensor = _dtensor_class()
        if self._layouts.get(opt_index) != layout:
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    name = self._param_name(opt_index, g, i, p, group)
                    _refuse_dtensor(dtensor, p, f"parameter {name}")
                    self._hook_backward_counter(p)
            self._layouts[opt_index] = layout
        selected = self.every is not None and step % self.every == 0
        full = selected or self.flight_recorder is not None  # the flight recorder keeps every step in memory
        with_stats = self.stats_every is not None and step % self.stats_every == 0
        if not (full or with_stats):
            return
        names = self._names[opt_index]
        snaps = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = names[id(p)]
                # The optimizer skips a parameter without a gradient, so there is nothing to record for it; with a
                # closure the gradient appears only inside step(), so that is decided after the step.
                if (p.grad is None and not closure_step) or not self._selected(name):
                    continue
                if dtensor is not None:  # a DTensor gradient or state of a plain parameter: stop at the first one
                    _refuse_dtensor(dtensor, p.grad, f"the gradient of {name}")
                    for key, value in optimizer.state.get(p, {}).items():
                        _refuse_dtensor(dtensor, value, f"optimizer state {key!r} of {name}")
                snap = ParamSnapshot(name=name, group=g, index_in_group=i, param_id=id(p))
                if full:
                    if "param" in self.what:
                        snap.param = _cpu_copy(p)
                    if "grad" in self.what and not closure_step:
                        snap.grad = _cpu_copy(p.grad)
                    if "state" in self.what:
                        snap.state = self._state_snapshot(optimizer.state.get(p, {}))
                elif with_stats:
                    # Statistics only: the one snapshot the update needs, kept on the parameter's device and freed
                    # after the step.
                    snap.param = p.detach().clone()
                snap.param_after = p  # replaced by a copy in the post-hook
                snaps.append(snap)
        backward = max((self._backward_counts.get(id(p), 0) for g in optimizer.param_groups for p in g["params"]),
                       default=0)
        pre_stats = None
        if with_stats and not full:
            # Gradient and state statistics must see the values before the step (the state is updated in place):
            # launched now for all parameters at once, read after the step with everything else.
            keys, tensors = [], []
            for snap in snaps:
                p = snap.param_after
                if p.grad is not None and not closure_step:
                    keys.append((snap.name, "grad"))
                    tensors.append(p.grad)
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.numel() > 0:
                        keys.append((snap.name, f"state.{key}"))
                        tensors.append(value)
            pre_stats = (keys, stats_rows(tensors, self._count_zeros(keys)))
        self._pending[opt_index] = RecordSnapshot(
            optimizer=opt_index, step=step, backward_pass=backward, wall_time=time.time(),
            hparams=[_group_hparams(g) for g in optimizer.param_groups], params=snaps, closure=closure_step,
            full=full, stats={} if with_stats else None, selected=selected, pre_stats=pre_stats)

    def _count_zeros(self, keys) -> list[bool]:
        return [kind.split(".")[0] in self.zero_counts for _, kind in keys]

    def _step_statistics(self, rec: RecordSnapshot, optimizer) -> dict:
        """Summary statistics of every recorded parameter at this step, with one device-to-host copy in all."""
        index, tensors, updates = [], [], []
        for snap in rec.params:
            live = snap.param_after  # the parameter itself, after the step
            if rec.full:  # statistics of the CPU copies taken for the full record
                kinds = {"param": snap.param, "grad": snap.grad}
                kinds.update({f"state.{k}": v for k, v in snap.state.items()})
            else:
                kinds = {"param": snap.param}
                if rec.closure and live.grad is not None:  # step(closure): the gradient of the last call
                    kinds["grad"] = live.grad
            for kind, t in kinds.items():
                if t is not None:
                    index.append((snap.name, kind))
                    tensors.append(t)
            if snap.param is not None:
                updates.append(snap)
        parts = [stats_rows(tensors, self._count_zeros(index))]
        update_tensors = []
        for snap in updates:
            live = snap.param_after.detach()
            update_tensors.append((_dense(live).to("cpu") if rec.full else live) - snap.param)
            index.append((snap.name, "update"))
        parts.append(stats_rows(update_tensors, "update" in self.zero_counts))
        sources = tensors + update_tensors
        if rec.pre_stats is not None:
            pre_keys, pre_rows = rec.pre_stats
            parts.insert(0, pre_rows)
            index = list(pre_keys) + index
            # A NaN/Inf recount reads the tensor again: the gradient is still there; the state has been updated
            # in place by the step, so its count is of the state after the step.
            live = {snap.name: snap.param_after for snap in rec.params}
            sources = [live[name].grad if kind == "grad" else
                       optimizer.state.get(live[name], {}).get(kind[len("state."):]) for name, kind in pre_keys] + sources
        host = to_host(parts)
        count_nonfinite(host, sources)
        for snap in rec.params:
            live_p = snap.param_after
            rec.stats_meta[snap.name] = {"name": snap.name, "group": snap.group, "index_in_group": snap.index_in_group,
                                         "shape": list(live_p.shape), "dtype": str(live_p.dtype).replace("torch.", "")}
        out: dict[str, dict] = {}
        for (name, kind), row in zip(index, host.tolist()):
            values = out.setdefault(name, {})
            for stat, v in zip(STATS, row):
                values[f"{kind}_{stat}"] = v
        for values in out.values():
            p_std = values.get("param_std", float("nan"))
            values[UPDATE_TO_DATA] = float(update_to_data(values.get("update_std", float("nan")), p_std))
            values[GRAD_TO_DATA] = float(grad_to_data(values.get("grad_std", float("nan")), p_std))
        return out

    @staticmethod
    def _state_snapshot(state: dict) -> dict:
        out = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[str(key)] = _cpu_copy(value)
            elif isinstance(value, (bool, int, float)):
                out[str(key)] = torch.tensor(float(value), dtype=torch.float64)
            # Other state (LBFGS's lists of history tensors, None buffers) has no fixed tensor shape to store.
        return out

    def _after_step(self, opt_index: int, optimizer: torch.optim.Optimizer) -> None:
        self._steps_done[opt_index] += 1
        rec = self._pending.pop(opt_index, None)
        if rec is None:
            return
        if rec.closure and "grad" in self.what and rec.full:
            # Parameters the closure gave no gradient were skipped by the optimizer, as in a plain step.
            rec.params = [snap for snap in rec.params if snap.grad is not None]
        if rec.stats is not None:
            rec.stats = self._step_statistics(rec, optimizer)
        if rec.full:
            for snap in rec.params:
                snap.param_after = _cpu_copy(snap.param_after) if "param" in self.what else None
        else:
            rec.params = []  # statistics only: release the device snapshots now
        if self.flight_recorder is None:
            self._writer.write(rec)
        else:
            self._flight_step(opt_index, rec)
        if self._tensorboard is not None and rec.stats:
            prefix = f"opt{opt_index}:" if opt_index else ""
            self._tensorboard.write(rec.step, {prefix + name: values for name, values in rec.stats.items()})
        if self.flight_recorder is None or rec.selected:
            self._records[opt_index] += 1

    # -- flight recorder --------------------------------------------------------------------------------------
    def _flight_step(self, opt_index: int, rec: RecordSnapshot) -> None:
        """Write what the cadences ask for, keep the full snapshot in the ring, dump the ring on a trigger."""
        if rec.selected or rec.stats is not None:
            self._writer.write(dataclasses.replace(rec, full=rec.selected))
            if rec.selected:
                self._written_steps[opt_index].append(rec.step)
        self._ring[opt_index].append(dataclasses.replace(rec, stats=None, full=True))
        reason = self._trigger(opt_index, rec)
        if reason:
            self._dump(opt_index, reason, rec.step)

    def _trigger(self, opt_index: int, rec: RecordSnapshot) -> str | None:
        grads = [s.grad for s in rec.params if s.grad is not None]
        updates = [s.param_after - s.param for s in rec.params if s.param is not None and s.param_after is not None]
        # Norms of the CPU snapshot: a NaN/Inf anywhere makes the norm non-finite.
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])))\
            if grads else 0.0
        update_norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(u.double()) for u in updates]))) if updates else 0.0
        history = self._norm_history[opt_index]
        reason = None
        if not math.isfinite(grad_norm):
            reason = f"non-finite gradient at step {rec.step}"
        elif not math.isfinite(update_norm):
            reason = f"non-finite update at step {rec.step}"
        elif len(history) >= 5:
            median_grad = statistics.median(h[0] for h in history)
            median_update = statistics.median(h[1] for h in history)
            if median_grad > 0 and grad_norm > self.spike_factor * median_grad:
                reason = (f"gradient norm spike at step {rec.step}: {grad_norm:.3g} > {self.spike_factor:g} x "
                          f"recent median {median_grad:.3g}")
            elif median_update > 0 and update_norm > self.spike_factor * median_update:
                reason = (f"update norm spike at step {rec.step}: {update_norm:.3g} > {self.spike_factor:g} x "
                          f"recent median {median_update:.3g}")
        if math.isfinite(grad_norm) and math.isfinite(update_norm):
            history.append((grad_norm, update_norm))
        return reason

    def _dump(self, opt_index: int, reason: str, trigger_step: int) -> None:
        written = self._written_steps[opt_index]
        steps = []
        for rec in self._ring[opt_index]:
            if rec.step in written:
                continue
            self._writer.write(rec)
            written.append(rec.step)
            steps.append(rec.step)
            self._records[opt_index] += 1
        self._ring[opt_index].clear()
        info = {"optimizer": opt_index, "reason": reason, "trigger_step": trigger_step, "steps": steps,
                "wall_time": time.time()}
        self.dumps.append(info)
        self._writer.add_dump(info)

    def dump(self, reason: str = "requested by the user") -> None:
        """Write the flight recorder's in-memory steps to the run now (e.g. from your own anomaly check)."""
        if self.flight_recorder is None:
            raise RuntimeError("dump() needs upd.record(..., flight_recorder=K)")
        if not self.active:
            return
        for opt_index in range(len(self.optimizers)):
            if self._ring[opt_index]:
                self._guard(self._dump, opt_index, reason, self._ring[opt_index][-1].step)

    # -- lifetime ---------------------------------------------------------------------------------------------
    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def records(self) -> int:
        """Records committed so far, over all optimizers."""
        return sum(self._records)

    def close(self) -> None:
        """Remove every hook and close the file. Safe to call twice, and after recording stopped on an error."""
        was_active = self.active
        self.active = False
        self._remove_hooks()
        self._pending.clear()
        if self._tensorboard is not None:
            self._tensorboard.close()
        _LIVE.discard(self)
        if was_active:
            try:
                try:
                    self._writer.set_attr("closed_cleanly", True)
                finally:
                    self._writer.close()
            except Exception as exc:
                # With the writer thread, a write error can surface only here: it is this run's error all the same.
                self.error = exc
                if self.strict:
                    raise
                warnings.warn(f"torch-upd: recording to {self.path} stopped ({type(exc).__name__}: {exc}); "
                              "what was committed before stays readable.", RecorderWarning, stacklevel=2)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "recording" if self.active else "closed"
        return f"<upd.Recorder {self.path!r} {state}, {self.records} records>"


def record(path, model=None, optimizer=None, **options) -> Recorder:
    """Record what ``optimizer.step()`` does, to one HDF5 file, without changing the training loop.

    ::

        with upd.record("runs/exp1.h5", model, optimizer):
            train()

    Args:
        path: the run file to create. An existing file is refused unless ``overwrite=True``.
        model: optional ``nn.Module``; parameter names come from ``model.named_parameters()``. Without it names
            come from the optimizer's ``param_names`` (when built from ``named_parameters()``), else
            ``group{g}.param{i}``.
        optimizer: a ``torch.optim.Optimizer`` or a list of them.
        every: record every N-th optimizer step (default 1: every step).
        include / exclude: glob pattern(s) on parameter names, e.g. ``include="*.weight"``.
        what: subset of ``("param", "grad", "state")`` to store (default all three).
        dtype: storage dtype: ``"keep"`` (default, exact), ``"float32"``, ``"float16"`` or ``"bfloat16"``.
            Smaller storage limits what ``upd verify`` can prove; its report says by how much.
        compression: ``None`` (default: float32 weights barely compress and it costs 2.5-35x write time),
            ``"lzf"`` or ``"gzip"``.
        overwrite: replace an existing file.
        resume: append to an existing run (training restarted from a checkpoint): step numbers continue from the
            optimizer's own step counter (or after the last recorded step for optimizers without one); a different
            optimizer class, parameter set or shape is an error. Without an existing file, starts a new run.
        zero_counts: whose fraction of exact zeros the statistics count: any of "param", "grad", "update",
            "state" (default: gradients only; counting is the slowest statistic on CPU, 4x a sum).
        flight_recorder: keep the last K steps' full tensors in memory (no disk I/O while nothing happens) and
            write them to the run when a trigger fires: a NaN/Inf in a gradient or update, a gradient- or
            update-norm spike above ``spike_factor`` (default 10) times its recent median, or ``rec.dump(reason)``.
            The reasons are stored (``Run.dumps``); the dumped steps replay and verify like any others.
        strict: raise recorder errors instead of warning once and stopping recording.
    """
    return Recorder(path, model, optimizer, **options)
