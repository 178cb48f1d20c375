"""What ``upd record`` installs in each process of the command once it has imported torch: it notes every
optimizer the program creates, counts backward passes from then on, and at an optimizer's first step hands the
optimizers to ``attach``, which starts recording them.

The bootstrap loads this file by its path, without importing the ``upd`` package (importing torch-upd's readers,
pandas and h5py, would slow down every process that imports torch, most of which never train): it imports only
torch, which is loaded by then, and ``upd`` at the first optimizer step. Optimizer creation is hooked by wrapping
``torch.optim.Optimizer.__init__`` (torch has no global creation hook), steps by torch's global optimizer step
pre-hook. Nothing here may break the program: a failure warns once and the process runs on unrecorded.
"""
from __future__ import annotations

import functools
import threading
import warnings
import weakref

import torch

_launcher = None  # this process's _Launcher, made by install()


def install(request: str) -> None:
    """Hook optimizer creation in this process (once); `request` is the launcher's environment variable's value."""
    global _launcher
    if _launcher is None:
        _launcher = _Launcher(request)
        _launcher.hook_optimizer_creation()


def _eager(fn):
    """`fn` excluded from torch.compile: a compiled ``optimizer.step`` calls the global hooks, and a compiled
    backward the counters; dynamo must not trace them (the recorder's own hooks are excluded the same way)."""
    return torch.compiler.disable(fn, reason="torch-upd's launcher runs eagerly")


class _Launcher:
    def __init__(self, request: str):
        self.request = request
        # Optimizers created and not yet handed to attach, in creation order (a dict's order; its keys are weak).
        self.waiting: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.handled: "weakref.WeakSet" = weakref.WeakSet()  # given to attach (recorded or not): never again
        # Backward passes per parameter since its optimizer was created: the recorder, made at the first step,
        # starts from these counts, as if it had been there from the start.
        self.backward_counts: dict[int, int] = {}
        self.counters: dict[int, object] = {}  # id(parameter) -> its counting hook's handle
        self.step_hook = None
        self.stopped = False
        self.lock = threading.RLock()

    # -- creation ---------------------------------------------------------------------------------------------
    def hook_optimizer_creation(self) -> None:
        optimizer_class = torch.optim.Optimizer
        original = optimizer_class.__init__
        if getattr(original, "_upd_launcher", False):
            return
        launcher = self

        @functools.wraps(original)
        def __init__(optimizer, *args, **kwargs):
            original(optimizer, *args, **kwargs)
            launcher.created(optimizer)
        __init__._upd_launcher = True
        optimizer_class.__init__ = __init__

    def created(self, optimizer) -> None:
        if self.stopped:
            return
        try:
            with self.lock:
                if self.step_hook is None:
                    # Registered with the first optimizer, not at torch's import: disabling dynamo imports it, which
                    # a process that never trains should not pay for.
                    from torch.optim.optimizer import register_optimizer_step_pre_hook
                    self.step_hook = register_optimizer_step_pre_hook(_eager(self.before_step))
                self.waiting[optimizer] = None
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        self.count_backward_passes(param)
        except Exception as exc:
            self.fail(exc)

    def count_backward_passes(self, param) -> None:
        key = id(param)
        if key in self.counters or not param.requires_grad or not param.is_leaf:
            return
        self.backward_counts[key] = 0

        def count(_param, key=key):
            self.backward_counts[key] += 1
        self.counters[key] = param.register_post_accumulate_grad_hook(_eager(count))

    # -- the first step ---------------------------------------------------------------------------------------
    def before_step(self, optimizer, args, kwargs):
        if self.stopped or optimizer in self.handled:
            return None
        with self.lock:
            if optimizer in self.handled:
                return None
            try:
                group, counts = self.take_group(optimizer)
                from upd.launcher import attach  # the first step: torch is fully imported by now
            except Exception as exc:
                self.fail(exc, "this Python cannot import upd" if isinstance(exc, ImportError) else "")
                return None
            attach.start(self.request, group, counts)  # warns itself; raises only with --strict
        return None

    def take_group(self, optimizer) -> tuple[list, dict[int, int]]:
        """`optimizer` and every other optimizer created so far that has not stepped yet, to be recorded together
        into one run (a GAN's two optimizers, a model's and its head's), with their parameters' backward counts;
        their counting stops here (the recorder counts from now on)."""
        group = list(self.waiting.keys())
        if not any(o is optimizer for o in group):
            group.append(optimizer)  # made without Optimizer.__init__ (unpickled): seen at its first step
        counts = {}
        for opt in group:
            self.handled.add(opt)
            self.waiting.pop(opt, None)
            for g in opt.param_groups:
                for param in g["params"]:
                    key = id(param)
                    if key in self.counters:
                        counts[key] = self.backward_counts.pop(key)
                        self.counters.pop(key).remove()
        return group, counts

    def fail(self, exc: BaseException, why: str = "") -> None:
        """Stop hooking this process, with one warning."""
        self.stopped = True
        for handle in self.counters.values():
            handle.remove()
        self.counters.clear()
        # The step hook stays (a no-op now): removing it from inside itself would change the dict torch is
        # iterating over, an error in the training loop.
        warnings.warn(f"torch-upd (upd record): cannot record this process ({why + ': ' if why else ''}"
                      f"{type(exc).__name__}: {exc}); it runs on unrecorded", RuntimeWarning, stacklevel=2)
