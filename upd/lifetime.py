"""What torch-upd must close before the process ends, in one place and in the one order that is safe.

Three kinds of objects hold files that must not be left to the interpreter's teardown:

* recorders: an open run is finished (``closed_cleanly``) only by ``Recorder.close()``, which also closes the
  recorder's writer, so its queued records are written;
* async writers, and the threads of async writers that were garbage collected while records were still queued:
  the writer thread is a daemon and would otherwise be stopped mid-record;
* runs open for reading: h5py's fileobj driver must not outlive the interpreter; a run left open at exit would crash
  HDF5's own shutdown (a segfault after the Python objects it calls are gone).

At interpreter exit they are closed in that order, while Python still runs: recorders first (closing their writers),
then writers opened on their own, then the collected writers' threads are waited for, then the runs.

On SIGTERM only the recorders are closed, then the signal does what it did before: the user's handler runs, or the
default action terminates the process. Only the recorders: the signal may land in the middle of a read of an open
run, and h5py cannot close a file from inside one of its own calls; when the process goes on (a user handler that
exits), the exit closes the rest. A SIGTERM that arrives while a recorder is inside its hook (an HDF5 write may be in
progress) waits until the hook returns, milliseconds later (``signals_deferred``).

Everything registered here belongs to the process that registered it. A forked child (a ``fork`` Pool's worker, a
data tool, ``os.fork``) inherits copies of the open recorders, writers and runs, but not the writer threads and not
the right to their files: closing a recorder there would wait forever on a thread that does not exist, and would
write into the parent's live file. So in a child every inherited object is forgotten at the fork
(``os.register_at_fork``): the child's exit and the child's SIGTERM close nothing of the parent's, and an inherited
recorder is inert (``owned_here`` is False: its hooks record nothing, its ``close()`` does nothing).

Forgetting is not enough for the files themselves: the child's copy of HDF5 still has the parent's run open, with a
metadata cache as it was at the fork, and flushes it when the child's interpreter ends (HDF5's own exit handler,
which Python cannot stop), over what the parent has written since: the run became unreadable ("wrong B-tree
signature"). So every descriptor through which this process writes a run (``written_through``) is pointed at
/dev/null in a child: whatever the child's HDF5 flushes goes nowhere, and the child holds no reference to the
run's open file description, so its locks are the parent's alone and end when the parent closes the run.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import warnings
import weakref


class _Open:
    """Objects of one kind that are open now. Held weakly unless `weak` is False: being registered here never keeps
    an object alive."""

    def __init__(self, weak: bool = True, closed_on_sigterm: bool = False):
        self._weak = weak
        self._objects = weakref.WeakSet() if weak else set()
        self._closed_on_sigterm = closed_on_sigterm
        _registries.append(self)

    def add(self, obj) -> None:
        _install_handlers(sigterm=self._closed_on_sigterm)
        if self._weak:
            _owner_pid[obj] = os.getpid()
        self._objects.add(obj)

    def discard(self, obj) -> None:
        self._objects.discard(obj)

    def __iter__(self):
        return iter(list(self._objects))  # a copy: closing an object removes it from the set


_registries: list = []  # every _Open, so that a forked child can forget what they hold
_owner_pid: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # object -> the pid that registered it
_written_fds: set = set()  # descriptors this process writes runs through (see the module docstring)


def written_through(fd: int) -> None:
    """`fd` is open on a run this process writes: a forked child gets /dev/null in its place."""
    if fd >= 0:
        _written_fds.add(fd)


def no_longer_written(fd: int) -> None:
    """Call before closing `fd`: the number may be reused for something a child should keep."""
    _written_fds.discard(fd)


def owned_here(obj) -> bool:
    """Whether `obj` belongs to this process: False for a recorder (writer, run) inherited through fork, which
    this process must neither use nor close. An object never registered belongs to whoever has it."""
    return _owner_pid.get(obj, os.getpid()) == os.getpid()


recorders = _Open(closed_on_sigterm=True)
writers = _Open()
writer_threads = _Open(weak=False)  # a collected writer's thread is still draining: it must be waited for
runs = _Open()

_install_lock = threading.Lock()
_at_exit_installed = False
_sigterm_installed = False
_inside_hooks: "weakref.WeakSet" = weakref.WeakSet()  # recorders inside a hook now
_pending_signal: list = []  # a SIGTERM that arrived while a recorder was inside its hook
_finish_signal = None  # what a deferred SIGTERM runs once the hook has returned


def _forget_after_fork() -> None:
    """In a forked child: the parent's objects are not ours to close (see the module docstring). Only plain
    attribute and set operations here: an h5py call could wait on a lock a parent thread held at the fork."""
    global _install_lock, _inside_hooks, _sigterm_installed, _sigterm_handlers, _forking_without_ours
    for recorder in list(recorders):
        try:
            recorder.active = False  # its hooks see this first and record nothing in the child
        except Exception:
            pass
    for registry in _registries:
        registry._objects = weakref.WeakSet() if registry._weak else set()
    _inside_hooks = weakref.WeakSet()  # a parent thread's hook does not run here: no SIGTERM waits for it
    _pending_signal.clear()
    _install_lock = threading.Lock()  # it may have been held by a parent thread at the fork
    # SIGTERM is as it was before torch-upd here (_before_fork); a recorder this child makes installs its own
    _sigterm_installed, _sigterm_handlers, _forking_without_ours = False, None, False
    _blind_written_files()


def _blind_written_files() -> None:
    if not _written_fds:
        return
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        for fd in _written_fds:
            try:
                os.dup2(devnull, fd)  # closes the child's reference to the run, keeps the number valid for HDF5
            except OSError:
                pass
    finally:
        os.close(devnull)
    _written_fds.clear()


# SIGTERM's disposition around a fork. A child is born with the one SIGTERM had before torch-upd's handler: Python
# drops a signal that reaches a child between fork() and the interpreter's own after-fork reset, which a Python
# handler makes possible and the default action does not (the kernel kills at once). A fork Pool's worker still
# starting when terminate() signals it, on a loaded machine, then never ended and training hung in join(); and a
# child owns no recorder for the handler to close anyway.
_sigterm_handlers: tuple | None = None  # (torch-upd's handler, the one before it), set when it is installed
_forking_without_ours = False  # the parent's handler was swapped for the fork in progress


def _before_fork() -> None:
    global _forking_without_ours
    ours, before = _sigterm_handlers or (None, None)
    if ours is None or before is None or threading.current_thread() is not threading.main_thread():
        return  # signal.signal works in the main thread only; a handler set outside Python cannot be put back
    try:
        if signal.getsignal(signal.SIGTERM) is ours:
            signal.signal(signal.SIGTERM, before)
            _forking_without_ours = True
    except (ValueError, OSError):
        pass


def _after_fork_in_parent() -> None:
    global _forking_without_ours
    if _forking_without_ours:
        _forking_without_ours = False
        signal.signal(signal.SIGTERM, _sigterm_handlers[0])


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_forget_after_fork)


def _close_recorders() -> None:
    for recorder in recorders:
        try:
            recorder.close()
        except Exception:
            pass


def close_all() -> None:
    """Close everything still open, in the safe order (see the module docstring). Runs at interpreter exit."""
    _close_recorders()
    for writer in writers:
        try:
            writer.close()
        except BaseException as exc:
            warnings.warn(f"torch-upd: writing {writer.path} failed ({type(exc).__name__}: {exc}); records after "
                          "the failure are missing", RuntimeWarning)
    for thread in writer_threads:
        thread.join()
    for run in runs:
        try:
            run.close()
        except Exception:
            pass


def _install_handlers(sigterm: bool) -> None:
    """Register close_all at exit on first use (after the libraries torch-upd uses registered theirs, so it runs
    before them), and the SIGTERM handler with the first recorder: once each."""
    global _at_exit_installed, _sigterm_installed
    if _at_exit_installed and (_sigterm_installed or not sigterm):
        return
    with _install_lock:
        if not _at_exit_installed:
            _at_exit_installed = True
            atexit.register(close_all)
        if sigterm and not _sigterm_installed:
            _sigterm_installed = True
            _install_sigterm_handler()


def _install_sigterm_handler() -> None:
    # Signal handlers can only be set from the main thread: a recorder made elsewhere is closed at exit only.
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        # Closing the file under a recorder's hook, inside an HDF5 write, could corrupt it: the hook finishes first.
        if len(_inside_hooks):
            _pending_signal.append((signum, frame))
            return
        finish(signum, frame)

    def finish(signum, frame):
        _close_recorders()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # default action: terminate, as if we had never been here
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    global _finish_signal, _sigterm_handlers
    _finish_signal = finish
    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        return
    _sigterm_handlers = (on_sigterm, previous)


class signals_deferred:
    """``with signals_deferred(recorder):`` the recorder is inside its hook: a SIGTERM arriving now is handled when
    the block ends. (A class rather than a generator: it runs three times per training step.)"""

    __slots__ = ("recorder",)

    def __init__(self, recorder):
        self.recorder = recorder

    def __enter__(self) -> None:
        _inside_hooks.add(self.recorder)

    def __exit__(self, *exc) -> None:
        _inside_hooks.discard(self.recorder)
        if _pending_signal and _finish_signal is not None:
            _finish_signal(*_pending_signal.pop())
