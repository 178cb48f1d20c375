"""``verify(..., jobs=N)``: the parameters of a run replayed in N processes (this one and N - 1 workers), for runs
that take one core minutes.

Each parameter's checks depend on that parameter's records only, and each step's on that step's, so the units of
work are parameters, and ranges of steps of a parameter that would otherwise take more than its share. Tasks
(units grouped up to about 1/(8N) of the run) are taken largest first by the workers and smallest first by this
process, each by whichever process claims it first (a shared flag per task), so no process waits for another to
start and none ends long after the others; each worker opens the run file itself, once, and reads only its units'
datasets. This process assembles the checks in the order a serial verify gives. Processes, not threads: the replay
is many small torch operations whose Python overhead holds the GIL.

Workers are forks of a fresh interpreter that imported torch and the rules once (the "forkserver" method; "spawn"
where there is none), never of the calling process (whose torch threads and open files a fork would copy), so they
know only the replay rules that importing a module registers: the built-in rules, the entry points, the ``--rules``
modules, and the module of every rule the run uses. A rule defined in ``__main__`` (a notebook, a script) cannot be
imported there: verify then runs serially. A run being written is read from a private copy (livelock.py) that
other processes cannot open, and is verified serially too.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

import torch

from ..runfile.reader import Run
from .registry import load_plugins

_RUNS: dict = {}  # per worker: path -> open Run
_CLAIMS = None  # per worker: the shared flags of the tasks some process has taken
WORKER_CPU: dict = {}  # in the parent: {worker process id: CPU seconds of its tasks} of the last parallel_checks


def worker_modules(rules, extra=()) -> list[str] | None:
    """Modules a worker imports so that it holds the same rules as this process, or None when a rule lives in a
    module a worker cannot import (``__main__``)."""
    modules = list(extra)
    for rule in rules:
        module = getattr(rule.fn, "__module__", None)
        if not module or module == "__main__":
            return None
        if module not in modules:
            modules.append(module)
    return modules


def _start(modules: list[str], claims) -> None:
    global _CLAIMS
    torch.set_num_threads(1)  # one core per worker: the workers are the parallelism
    load_plugins(modules)
    _CLAIMS = claims


def _claim(claims, index: int) -> bool:
    """Take task `index` for this process: False when another process took it first."""
    with claims.get_lock():
        if claims[index]:
            return False
        claims[index] = 1
        return True


def _checks_of(work: Callable, index: int, path: str, units: list, rtol, ulps,
               block_elements) -> tuple[list, int, float] | None:
    """Worker: task `index`, the checks `work` finds of each (optimizer index, parameter name, first row, end row) of
    the run file at `path` (opened once per worker), with this process's id and the CPU seconds the task took; None
    when the parent took the task first."""
    if not _claim(_CLAIMS, index):
        return None
    started = time.process_time()
    run = _RUNS.get(path)
    if run is None:
        run = _RUNS[path] = Run(path)
    return work(run, units, rtol, ulps, block_elements), os.getpid(), time.process_time() - started


def split_rows(units: dict, jobs: int) -> dict:
    """Work units {(path, optimizer index, name, first row, end row): cost} with every unit costing more than
    1/(4 jobs) of the total cut into row ranges of about that cost: the steps of a parameter are checked
    independently, so one large parameter of a long run is shared by the workers instead of setting the pace.
    (A parameter recorded at a single step is one unit whatever its size.)"""
    target = sum(units.values()) / (4 * jobs)
    out = {}
    for (path, opt_index, name, lo, hi), cost in units.items():
        per_row = cost / max(1, hi - lo)
        step = max(1, int(target // per_row)) if per_row else hi - lo
        if cost <= target or step >= hi - lo:
            out[(path, opt_index, name, lo, hi)] = cost
            continue
        for first in range(lo, hi, step):
            end = min(first + step, hi)
            out[(path, opt_index, name, first, end)] = per_row * (end - first)
    return out


def batches(costs: dict, jobs: int) -> list[list]:
    """Work units {unit: cost} in tasks, largest first, each small units grouped up to about 1/(8 jobs) of the
    total: the pool hands the next task to whichever worker is free, which balances the load."""
    target = sum(costs.values()) / (8 * jobs)
    out, current, current_cost = [], [], 0
    for unit, cost in sorted(costs.items(), key=lambda kv: -kv[1]):
        current.append(unit)
        current_cost += cost
        if current_cost >= target:
            out.append(current)
            current, current_cost = [], 0
    return out + ([current] if current else [])


@contextlib.contextmanager
def _main_not_rerun():
    """Start workers without re-running the caller's script in them: multiprocessing's fresh interpreters import
    ``__main__`` again (a script without an ``if __name__ == "__main__"`` guard would start verify again there).
    The workers need none of it: they import the rule modules they are given."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


def parallel_checks(work: Callable, units: dict, jobs: int, modules: list[str], *, runs: dict | None = None,
                    rtol=None, ulps=None, block_elements=None) -> dict:
    """{(path, optimizer index, name, first row, end row): cost} -> {same key: [Check]}, computed in `jobs`
    processes: jobs - 1 workers and this one, given `runs` ({path: open Run}), or jobs workers. `work(run, units,
    rtol, ulps, block_elements)` gives the checks of some units of an open run (engine.checks_in: a module-level
    function, which the workers unpickle by name).

    This process takes tasks from the small end of the queue while the workers take them from the large end (a
    shared flag per task says who took it): until the worker server has started (it imports torch: seconds) the
    work is done here, and nothing waits for it. WORKER_CPU then holds the CPU seconds of each process's tasks,
    this one's included (benchmarks/verify_speed.py reports them)."""
    WORKER_CPU.clear()
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # The server imports torch and the rules once; each worker is then a fork of it, started in milliseconds.
        context.set_forkserver_preload(["upd.replay.engine", *modules])
    else:
        context = multiprocessing.get_context("spawn")
    runs = runs or {}
    tasks = []  # (path, units), largest first
    for task in batches(units, jobs):
        by_path: dict = {}
        for path, *unit in task:
            by_path.setdefault(path, []).append(tuple(unit))
        tasks += list(by_path.items())
    claims = context.Array("b", len(tasks))
    results = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs - 1 if runs else jobs), mp_context=context,
                             initializer=_start, initargs=(modules, claims)) as pool:
        with _main_not_rerun():  # the workers start at the first submits
            futures = [pool.submit(_checks_of, work, i, path, part, rtol, ulps, block_elements)
                       for i, (path, part) in enumerate(tasks)]
        here = os.getpid()
        for i in reversed(range(len(tasks))):  # the smallest tasks first
            path, part = tasks[i]
            if path not in runs or not _claim(claims, i):  # the workers have come this far
                break
            started = time.process_time()
            found = work(runs[path], part, rtol, ulps, block_elements)
            WORKER_CPU[here] = WORKER_CPU.get(here, 0.0) + time.process_time() - started
            results.update({(path, *unit): checks for unit, checks in zip(part, found)})
        for (path, part), future in zip(tasks, futures):
            done = future.result()
            if done is None:  # taken here
                continue
            found, pid, seconds = done
            WORKER_CPU[pid] = WORKER_CPU.get(pid, 0.0) + seconds
            results.update({(path, *unit): checks for unit, checks in zip(part, found)})
    return results
