"""``verify(..., jobs=N)``: the parameters of a run replayed in N worker processes, for runs that take one core
minutes.

Each parameter's checks depend on that parameter's records only, so parameters are the unit of work: they are
dealt to the workers largest first (by bytes recorded), each worker opens the run file itself and returns its
checks, and the parent assembles them in the order a serial verify gives. Processes, not threads: the replay is
many small torch operations whose Python overhead holds the GIL.

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
import sys
from concurrent.futures import ProcessPoolExecutor

_RUNS: dict = {}  # per worker: path -> open Run


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


def _start(modules: list[str]) -> None:
    import torch

    from .registry import load_plugins

    torch.set_num_threads(1)  # one core per worker: the workers are the parallelism
    load_plugins(modules)


def _checks_of(path: str, units: list, rtol, ulps, block_elements) -> list:
    """Worker: the checks of each (optimizer index, parameter name) of the run file at `path`."""
    from ..runfile.reader import Run
    from .engine import OptimizerReplay, param_checks

    run = _RUNS.get(path)
    if run is None:
        run = _RUNS[path] = Run(path)
    out = []
    replays = {}
    for opt_index, name in units:
        opt = next(o for o in run.optimizers if o.index == opt_index)
        if opt_index not in replays:
            replays[opt_index] = OptimizerReplay.of(run, opt, rtol=rtol, ulps=ulps)
        out.append(param_checks(replays[opt_index], opt.param_records[name], block_elements))
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


def parallel_checks(units: dict, jobs: int, modules: list[str], *, rtol=None, ulps=None,
                    block_elements=None) -> dict:
    """{(path, optimizer index, name): cost} -> {same key: [Check]}, computed in `jobs` processes."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # The server imports torch and the rules once; each worker is then a fork of it, started in milliseconds.
        context.set_forkserver_preload(["upd.replay.engine", *modules])
    else:
        context = multiprocessing.get_context("spawn")
    results = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_start,
                             initargs=(modules,)) as pool:
        futures = []
        with _main_not_rerun():  # the workers start at the first submits
            for task in batches(units, jobs):
                by_path: dict = {}
                for path, opt_index, name in task:
                    by_path.setdefault(path, []).append((opt_index, name))
                for path, part in by_path.items():
                    futures.append((path, part, pool.submit(_checks_of, path, part, rtol, ulps, block_elements)))
        for path, part, future in futures:
            for (opt_index, name), checks in zip(part, future.result()):
                results[(path, opt_index, name)] = checks
    return results
