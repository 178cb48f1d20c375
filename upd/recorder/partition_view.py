"""An optimizer that steps flat partitions, shown to the recorder as the named parameters inside them.

DeepSpeed ZeRO and FSDP1 (``use_orig_params=False``) hand their ``torch.optim.Optimizer`` flat 1-d tensors: each
concatenates runs of the flattened elements of several model parameters (this rank's partition). The recorder
records what an optimizer's ``param_groups`` hold, so a ``PartitionView`` stands in for such an optimizer: its
param groups hold one *fragment* per (parameter, flat tensor) pair, a 1-d tensor that aliases the parameter's run
inside the flat tensor (no copy), named after the model parameter and tagged with the ``ShardLayout`` that says
where the run sits in the whole parameter (part layout "flat"). Its ``state`` holds the same runs of the optimizer's
state, its fragments' ``.grad`` the same runs of the flat gradient. The wrapper registry's flat kinds
(``wrappers/deepspeed.py``, ``wrappers/fsdp1.py``) build one from their own mapping.

One recorded step, several optimizer steps: DeepSpeed calls the optimizer's ``step()`` once per param group (ZeRO-1/2
swap ``param_groups`` to one group, ZeRO-3 fill one group's ``params`` per sub-group). The recorder must see one
step with every gradient present, so the view runs the recorder's pre-step hook at the call that completes the set
and its post-step hook right after that call: flats stepped by the earlier calls are kept as they were before their
step (one copy of each, and of its state) and shown during the pre-step hook, then the fragments point at the live
tensors again. A step of a single call (one group, FSDP1) copies nothing.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..runfile import schema
from ..runfile.encoding import class_path
from ..runfile.record import ShardLayout

# The attribute a fragment carries its ShardLayout in (wrapper_registry's flat kinds read it in shard_layout).
FRAGMENT_LAYOUT = "_upd_flat_layout"


@dataclass(frozen=True)
class Fragment:
    """One parameter's run of elements inside one flat tensor of the optimizer."""

    name: str  # the model parameter's name
    group: int  # the index of the param group (of the optimizer the user built) the parameter belongs to
    flat: int  # which flat tensor (index into PartitionView.flats)
    start: int  # the run's first element in the flat tensor
    count: int  # its length
    offset: int  # the index of its first element in the parameter flattened in row-major order
    shape: tuple  # the whole parameter's shape


def fragment_layout(tensor) -> ShardLayout | None:
    return getattr(tensor, FRAGMENT_LAYOUT, None)


def _point(view: torch.Tensor, flat: torch.Tensor, start: int, count: int, shape: tuple | None = None) -> None:
    """Make `view` alias flat[start:start + count] (same tensor object: the recorder knows parameters by id), in
    `shape` where given (a whole parameter)."""
    with torch.no_grad():
        # no strides given: set_ makes them contiguous, as a run of the flat tensor is
        view.set_(flat.untyped_storage(), flat.storage_offset() + start, (count,) if shape is None else tuple(shape))


def _run(value, flat: torch.Tensor, start: int, count: int, shape: tuple | None = None):
    """A state or gradient tensor shaped like the flat tensor, narrowed to one run (in `shape` where given);
    anything else as it is."""
    if isinstance(value, torch.Tensor) and value.shape == flat.shape:
        run = value.detach().narrow(0, start, count)
        return run if shape is None else run.view(shape)
    return value


class PartitionView(torch.optim.Optimizer):
    """The optimizer `inner`, which steps the 1-d tensors `flats`, seen as the fragments inside them. Made by
    ``partition_view()`` as a subclass of `inner`'s class (the run records that class, and replays it).

    `job_names`: every model parameter whose elements the job's flat tensors hold, on any rank, in an order every
    rank derives alike (a rank's fragments are some of them): what a job's live statistics combine, per name."""

    def __init__(self, inner: torch.optim.Optimizer, flats: list, groups: list[dict], fragments: list[Fragment],
                 world_size: int, describe_step=None, *, job_names: list[str]):
        # torch.optim.Optimizer.__init__ is not run: this object never steps; it holds what the recorder reads.
        self.inner = inner
        self.flats = list(flats)
        self.fragments = list(fragments)
        self.job_names = list(job_names)
        self.defaults = inner.defaults
        self._real_groups = groups  # the optimizer's own param group dicts, one per fragment group index
        self._describe_step = describe_step  # () -> {hyperparameter-like facts of this step}, e.g. the loss scale
        self._optimizer_step_pre_hooks = OrderedDict()  # never run: hooks go to `inner` (register_step_*_hook)
        self._optimizer_step_post_hooks = OrderedDict()
        self.views: list[torch.Tensor] = []
        # One process holds every parameter whole: its fragments are shown in the parameters' shapes, as whole
        # tensors (no layout); a part of a parameter is a 1-d run, tagged with its layout.
        self._shapes = [tuple(f.shape) if world_size == 1 and f.offset == 0 and f.count == math.prod(f.shape)
                        else None for f in self.fragments]
        for fragment, shape in zip(self.fragments, self._shapes):
            # requires_grad as the flat tensor's: a fragment the optimizer steps is no frozen parameter.
            flat = self.flats[fragment.flat]
            view = torch.empty(0, dtype=flat.dtype, device=flat.device, requires_grad=flat.requires_grad)
            self.views.append(view)
            if shape is not None:
                continue
            setattr(view, FRAGMENT_LAYOUT, ShardLayout(
                global_shape=list(fragment.shape), offset=[fragment.offset], placements=[schema.PART_FLAT],
                mesh_shape=[world_size], part_layout=schema.PART_FLAT))
        self.param_groups = [{"params": [v for v, f in zip(self.views, self.fragments) if f.group == g]}
                             for g in range(len(groups))]
        self.state: dict = {}
        self._kept: dict[int, tuple] = {}  # flat index -> (its copy, its state's copy, its gradient) before its step
        self._started = False
        self._show({})

    @property
    def names(self) -> dict[int, str]:
        """id(fragment) -> the model parameter's name."""
        return {id(v): f.name for v, f in zip(self.views, self.fragments)}

    # -- what the fragments show ------------------------------------------------------------------------------
    def _show(self, kept: dict) -> None:
        """Point every fragment at its flat tensor (or, for the flats in `kept`, at their copy from before their
        step), with the matching runs of the gradient and the state, and refresh the groups' hyperparameters."""
        self.state = {}
        for view, fragment, shape in zip(self.views, self.fragments, self._shapes):
            live = self.flats[fragment.flat]
            flat, state, grad = kept.get(fragment.flat) or (live, self.inner.state.get(live, {}), live.grad)
            _point(view, flat, fragment.start, fragment.count, shape)
            view.grad = None if grad is None else _run(grad, live, fragment.start, fragment.count, shape)
            self.state[view] = {k: _run(v, live, fragment.start, fragment.count, shape) for k, v in state.items()}
        extra = self._describe_step() if self._describe_step is not None else {}
        for group, real in zip(self.param_groups, self._real_groups):
            for key, value in real.items():
                if key != "params":
                    group[key] = value
            group.update(extra)

    def _stepping(self, inner) -> list[int]:
        held = {id(p) for group in inner.param_groups for p in group["params"]}
        return [i for i, flat in enumerate(self.flats) if id(flat) in held]

    def _begins(self, inner) -> bool:
        """Called before each step() of `inner`: whether the recorded step begins now (the call that completes
        the set of flats; the earlier calls' flats are kept as they were before their step)."""
        stepping = self._stepping(inner)
        self._started = False
        if not stepping:
            return False
        if any(i in self._kept for i in stepping):
            self._kept.clear()  # a step that ended without its last call (an overflow, an error): start anew
        if len(self._kept) + len(stepping) < len(self.flats):
            for i in stepping:
                flat = self.flats[i]
                state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                         for k, v in self.inner.state.get(flat, {}).items()}
                self._kept[i] = (flat.detach().clone(), state, flat.grad)
            return False
        self._show(self._kept)
        self._started = True
        return True

    def _ends(self) -> bool:
        """Called after each step() of `inner`: whether the recorded step ends now."""
        if not self._started:
            return False
        self._started = False
        grads = {i: kept[2] for i, kept in self._kept.items()}
        self._kept.clear()
        self._show({})
        for view, fragment, shape in zip(self.views, self.fragments, self._shapes):  # the earlier calls' gradients
            if fragment.flat in grads and grads[fragment.flat] is not None:  # are gone from the flats
                view.grad = _run(grads[fragment.flat], self.flats[fragment.flat], fragment.start, fragment.count,
                                 shape)
        return True

    # -- hooks: on the optimizer that steps --------------------------------------------------------------------
    def register_step_pre_hook(self, hook):
        def pre_hook(inner, args, kwargs):
            if self._begins(inner):
                hook(self, (self, *args[1:]), kwargs)  # no closure: the wrappers that use a view step without one
        return self.inner.register_step_pre_hook(pre_hook)

    def register_step_post_hook(self, hook):
        def post_hook(inner, args, kwargs):
            if self._ends():
                hook(self, (self, *args[1:]), kwargs)
        return self.inner.register_step_post_hook(post_hook)

    def step(self, closure=None):
        raise RuntimeError("a torch-upd PartitionView does not step; its inner optimizer does")

    def __repr__(self) -> str:
        return (f"<PartitionView of {type(self.inner).__name__}: {len(self.fragments)} fragments in "
                f"{len(self.flats)} flat tensors>")


_VIEW_CLASSES: dict[type, type] = {}


def partition_view(inner: torch.optim.Optimizer, flats: list, groups: list[dict], fragments: list[Fragment],
                   world_size: int, describe_step=None, *, job_names: list[str]) -> PartitionView:
    """A PartitionView of `inner` whose class the run records as `inner`'s (its module and name), so that
    ``upd verify`` replays the optimizer that stepped."""
    cls = type(inner)
    view_class = _VIEW_CLASSES.get(cls)
    if view_class is None:
        # Named so that the run names it as it names `cls` (torch.optim.AdamW, not torch.optim.adamw.AdamW).
        module, _, qualname = class_path(cls).rpartition(".")
        view_class = type(cls.__name__, (PartitionView, cls), {"__module__": module, "__qualname__": qualname})
        _VIEW_CLASSES[cls] = view_class
    return view_class(inner, flats, groups, fragments, world_size, describe_step, job_names=job_names)
