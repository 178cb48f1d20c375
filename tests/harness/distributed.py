"""Real multi-process jobs on the CPU: torch.multiprocessing workers in a gloo process group.

``run_job(worker, world_size, *args)`` starts `world_size` processes, each calling ``worker(rank, world_size,
*args)`` inside an initialised process group, and returns what each worker returned (picklable values), in rank
order. A worker that raises fails the job with its traceback. Workers must be module-level functions (they are
pickled by reference).

The workers are forked from a forkserver (one per test process, started at the first job) that imported torch,
pandas, h5py and upd once (PRELOAD), each worker then with the environment and working directory of the process that
starts the job, as a spawned one would have: a spawned worker imported torch again, about 2 s of CPU per rank.
"""
from __future__ import annotations

import os
import runpy
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_script(script: str, *args: str, cwd: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the file `script` with `args` on two processes through torchrun (`--standalone`: a free port of its own),
    one torch thread each and the repository on PYTHONPATH, from `cwd`; its completed process, output captured."""
    from tests.harness.paths import REPO_ROOT

    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def job_path(folder: str, optimizer: str, mode: str) -> str:
    """Where a test job of one optimizer configuration and recording mode records to, inside `folder`."""
    return os.path.join(folder, f"{optimizer}-{mode}.h5")


def record_references(folder, optimizers: dict, make_model, train, **record_options) -> dict:
    """The single-process reference of a job: for each {name: make_optimizer}, a fresh `make_model()` trained by
    `train(model, optimizer, slice(None))` on the whole global batch, recorded to folder/<name>.h5: {name: path}."""
    import upd

    paths = {}
    for name, make in optimizers.items():
        model = make_model()
        optimizer = make(model.parameters())
        paths[name] = os.path.join(str(folder), f"{name}.h5")
        with upd.record(paths[name], model, optimizer, strict=True, **{"every": 1, **record_options}):
            train(model, optimizer, slice(None))
    return paths


# Imported once in the forkserver, before any torch operation (no thread pool yet): what every worker imports.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "numpy", "pandas", "h5py", "click", "upd",
           "upd.recorder.recorder", "upd.runfile.reader", "tests.harness.distributed"]


def _entry(rank, world_size, port, worker, args, results, environ=None, cwd=None):
    if environ is not None:  # the job starter's, not the forkserver's (as old as its first job)
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # 2 cores shared by every worker
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", worker(rank, world_size, *args))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _join_within(context, timeout: float) -> None:
    """Wait for every process of `context` (mp.start_processes); kill them all and fail past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"the job did not finish within {timeout:g} s")


def run_job(worker, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run worker(rank, world_size, *args) on world_size gloo processes; the workers' return values by rank."""
    ctx = mp.get_context("spawn")
    mp.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts, at the first job
    with ctx.Manager() as manager:
        results = manager.dict()
        context = mp.start_processes(_entry, args=(world_size, free_port(), worker, args, results, dict(os.environ),
                                                   os.getcwd()),
                                     nprocs=world_size, join=False, start_method="forkserver")
        try:
            _join_within(context, timeout)
        except mp.ProcessRaisedException as exc:
            errors = [v[1] for v in results.values() if v[0] == "error"]
            raise AssertionError("a worker failed:\n" + ("\n".join(errors) or str(exc))) from None
        return [results[r][1] for r in range(world_size)]


def _script_entry(rank, world_size, port, script, args, environ, cwd, output):
    for fd, name in ((1, f"{output}.rank{rank}.out"), (2, f"{output}.rank{rank}.err")):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.chdir(cwd)
    torch.set_num_threads(1)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def run_script_job(script: str, *args: str, cwd: str, world_size: int = 2, timeout: float = 180.0) -> list:
    """The file `script` run as __main__ with `args` on world_size ranks forked from run_job's forkserver, each with
    the variables torchrun gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT: the
    script initialises its process group itself), from `cwd`. For a test whose subject is the job's files rather
    than the launch: torchrun_script starts three processes that each import torch. Returns each rank's
    (stdout, stderr)."""
    import tempfile

    mp.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "job")
        context = mp.start_processes(_script_entry, args=(world_size, free_port(), script, args, dict(os.environ),
                                                          str(cwd), output),
                                     nprocs=world_size, join=False, start_method="forkserver")
        try:
            _join_within(context, timeout)
        except mp.ProcessException as exc:
            raise AssertionError(f"a rank failed:\n{exc}") from None
        outputs = []
        for rank in range(world_size):
            with open(f"{output}.rank{rank}.out") as out, open(f"{output}.rank{rank}.err") as err:
                outputs.append((out.read(), err.read()))
        return outputs
