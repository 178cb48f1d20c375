"""Recording data-parallel jobs: DDP (rank 0 by default, every replica with ranks="all", checked for agreement),
ZeroRedundancyOptimizer (each rank its partition), resume per rank, and a rank killed mid-run.

Real jobs: gloo process groups of 2 processes on the CPU (tests.harness.distributed), a tiny MLP, a few steps. One
job records the runs all but one of the tests look at (module fixture `job`), since starting one costs seconds; the
killed rank has a job of its own.
"""
from __future__ import annotations

import datetime
import os
import shutil
import signal
import time

import h5py
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import upd
from upd.analyzer.findings import REPLICAS
from upd.recorder import distributed
from upd.replay.engine import EXIT_MATCH, EXIT_MISMATCH, replica_checks
from upd.runfile import schema
from upd.runfile.ranks import rank_files, rank_path
from tests.harness.distributed import PRELOAD, free_port, run_job
from tests.harness.training import MLP, train_steps

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
STEPS = 4


# -- workers (module level: spawned processes import them by name) ---------------------------------------------------
def _record_ddp(folder: str, name: str, ranks, rank: int) -> dict:
    torch.manual_seed(0)
    model = DDP(MLP())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(os.path.join(folder, name), model, opt, ranks=ranks, every=1) as rec:
        hooked = bool(opt._optimizer_step_pre_hooks)
        was_active = rec.active
        train_steps(model, opt, steps=STEPS, seed=rank)  # each rank its own data; DDP averages the gradients
    return {"active": was_active, "hooked": hooked, "path": rec.path}


def _record_drifting_replicas(folder: str, rank: int) -> None:
    """Replicated training that forgot to all-reduce its gradients: each replica follows its own data."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(os.path.join(folder, "drift.h5"), model, opt, ranks="all", every=1):
        train_steps(model, opt, steps=STEPS, seed=rank)


def _record_zero(folder: str, rank: int) -> list:
    from torch.distributed.optim import ZeroRedundancyOptimizer  # its import warns about torch.jit, 66 times

    torch.manual_seed(0)
    model = DDP(MLP())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    with upd.record(os.path.join(folder, "zero.h5"), model, opt, every=1):
        train_steps(model, opt, steps=STEPS, seed=rank)
    return sorted(name for name, p in model.module.named_parameters()
                  if any(p is q for g in opt.optim.param_groups for q in g["params"]))


def _sgd_replicas(path: str, rank: int, resume: bool, seed: int):
    """DDP with plain SGD recorded on every rank; resuming restores the parameters from rank 0's file of the job
    (the recorded parameters after the last step stand in for a checkpoint)."""
    torch.manual_seed(0)
    model = MLP()
    if resume:
        with upd.open_run(rank_files(path)[1][0]) as run:
            last = {name: p.read(schema.KIND_PARAM_AFTER, p.num_rows - 1)
                    for name, p in run.optimizers[0].param_records.items()}
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(last[name])
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with upd.record(path, model, opt, ranks="all", resume=resume, every=1):
        train_steps(model, opt, steps=STEPS, seed=seed + rank)


def _resume(folder: str, rank: int) -> str | None:
    """Record resume.h5, then restart from it as a resumed training does (each rank continues its own file); then
    resume a job of 3 processes (copies of the files, as one would have left them) on these 2: the refusal."""
    path = os.path.join(folder, "resume.h5")
    _sgd_replicas(path, rank, resume=False, seed=0)
    dist.barrier()  # both files closed
    _sgd_replicas(path, rank, resume=True, seed=100)
    larger = os.path.join(folder, "larger.h5")
    if rank == 0:
        for r in range(3):
            shutil.copy(rank_path(path, min(r, 1), 2), rank_path(larger, r, 3))
    dist.barrier()  # the 3-process job's files are there
    try:
        _sgd_replicas(larger, rank, resume=True, seed=100)
    except ValueError as exc:
        return str(exc)
    return None


def main_worker(rank: int, world_size: int, folder: str) -> dict:
    results = {"ddp": _record_ddp(folder, "ddp.h5", None, rank),
               "replicas": _record_ddp(folder, "replicas.h5", "all", rank), "zero": _record_zero(folder, rank)}
    _record_drifting_replicas(folder, rank)
    results["refused"] = _resume(folder, rank)
    return results


# -- the jobs ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("job"))
    results = run_job(main_worker, 2, folder)
    return folder, results


@pytest.mark.slow
def test_ddp_records_on_rank_0_into_the_path_itself(job):
    folder, results = job
    path = os.path.join(folder, "ddp.h5")
    assert rank_files(path) == (0, {})
    assert results[0]["ddp"] == {"active": True, "hooked": True, "path": path}
    assert results[1]["ddp"] == {"active": False, "hooked": False, "path": path}  # no file, no hooks
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].param_records) == NAMES  # through DDP: no "module." prefix
        assert run.params_not_optimized == []
        assert run.meta[schema.META_DISTRIBUTED] == {"rank": 0, "world_size": 2, "recording_ranks": [0],
                                           "parallelism": "ddp", "job_path": path}
        assert list(run.optimizers[0].steps) == list(range(STEPS))
        report = upd.verify(run)
    assert report.exit_code == EXIT_MATCH, report.summary()
    assert report.matched == len(NAMES) * STEPS


@pytest.mark.slow
def test_ddp_ranks_all_records_every_replica_and_they_agree(job):
    folder, _ = job
    path = os.path.join(folder, "replicas.h5")
    assert not os.path.exists(path)
    world, files = rank_files(path)
    assert world == 2 and list(files) == [0, 1]
    for rank, f in files.items():
        with upd.open_run(f) as run:  # a rank's file on its own
            assert run.meta[schema.META_DISTRIBUTED]["rank"] == rank
            assert run.meta[schema.META_DISTRIBUTED]["recording_ranks"] == "all"
            assert list(run.optimizers[0].param_records) == NAMES
            assert upd.verify(run).exit_code == EXIT_MATCH
    with upd.open_run(path) as job:  # the job: each parameter once, held whole by both ranks
        assert list(job.optimizers[0].param_records) == NAMES
        assert {p.layout for p in job.iter_params()} == {"replicated"}
        assert replica_checks(job.ranks) == []
        report = upd.verify(job)
    assert report.exit_code == EXIT_MATCH, report.summary()
    assert (f"distributed job of 2 processes (ddp): each rank's file replayed on its own: {len(NAMES)} replicated "
            "on several ranks checked on each, replicas compared") in report.summary()
    assert report.matched == 2 * len(NAMES) * STEPS  # every replica replayed, and they agree


@pytest.mark.slow
def test_a_perturbed_replica_is_named_with_its_rank_step_and_parameter(job, tmp_path):
    folder, _ = job
    _, files = rank_files(os.path.join(folder, "replicas.h5"))
    path = str(tmp_path / "replicas.h5")
    for rank, f in files.items():
        shutil.copy(f, rank_path(path, rank, 2))
    with h5py.File(rank_path(path, 1, 2), "r+") as f:
        ds = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name="fc2.weight")]
        row = ds[2]
        row[1, 3] += 1e-3
        ds[2] = row
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    replica = bad[bad["note"].str.startswith("replica")]
    assert list(zip(replica["rank"], replica["param"], replica["step"])) == [(1, "fc2.weight", 2)]
    note = replica["note"].iloc[0]
    assert note.startswith("replica on rank 1 differs from rank 0 at step 2 (max abs diff 0.001")
    assert "after the step" in note
    # Rank 1's own replay of that step fails too (its recorded update is no longer the optimizer's); nothing else.
    assert set(zip(bad["rank"], bad["param"], bad["step"])) == {(1, "fc2.weight", 2)}


@pytest.mark.slow
def test_replicas_that_drift_apart_are_caught_though_each_replays(job):
    """Forgetting the gradient all-reduce: every replica replays its own math exactly, only comparing them shows it."""
    folder, _ = job
    _, files = rank_files(os.path.join(folder, "drift.h5"))
    for f in files.values():
        with upd.open_run(f) as run:
            assert run.meta[schema.META_DISTRIBUTED]["parallelism"] == "replicated"
            assert upd.verify(run).exit_code == EXIT_MATCH
    report = upd.verify(os.path.join(folder, "drift.h5"))
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    # Same start (one seed), different data: every parameter differs right after step 0, and only there is named.
    assert sorted(bad["param"]) == sorted(NAMES)
    assert set(zip(bad["rank"], bad["step"])) == {(1, 0)}
    assert bad["note"].str.startswith("replica on rank 1 differs from rank 0 at step 0").all()
    # upd analyze finds it too (the replicas are small enough to compare there), with the rank, step and weights.
    found = [f for f in upd.analyze(os.path.join(folder, "drift.h5")).findings if f.kind == REPLICAS]
    assert len(found) == 1 and found[0].step == 0 and sorted(found[0].params) == sorted(NAMES)
    assert found[0].text.startswith("replica on rank 1 diverges")
    # DDP's replicas (the gradients all-reduced) agree: no such finding.
    assert not [f for f in upd.analyze(os.path.join(folder, "replicas.h5")).findings if f.kind == REPLICAS]


@pytest.mark.slow
def test_zero_each_rank_records_its_partition(job):
    folder, results = job
    path = os.path.join(folder, "zero.h5")
    world, files = rank_files(path)
    assert world == 2 and list(files) == [0, 1]  # partitioned: every rank records, automatically
    held = []
    for rank, f in files.items():
        with upd.open_run(f) as run:
            names = sorted(run.optimizers[0].param_records)
            assert names == results[rank]["zero"]  # what this rank's local optimizer steps
            assert run.optimizers[0].class_name == "torch.optim.Adam"
            assert run.params_not_optimized == []  # the other partitions belong to the job's optimizer too
            assert run.meta[schema.META_DISTRIBUTED]["parallelism"] == "zero"
            report = upd.verify(run)
            assert report.exit_code == EXIT_MATCH, report.summary()
            assert report.matched == len(names) * STEPS
        held += names
    assert sorted(held) == sorted(NAMES)  # the partitions: disjoint, and every parameter
    with upd.open_run(path) as job:
        assert {p.name: p.ranks for p in job.iter_params()} == {
            name: [rank for rank in (0, 1) if name in results[rank]["zero"]] for name in NAMES}
        report = upd.verify(job)
    assert report.exit_code == EXIT_MATCH, report.summary()
    # partitions, not replicas: the summary says how the job holds its parameters
    assert (f"distributed job of 2 processes (zero): each rank's file replayed on its own: {len(NAMES)} held whole by "
            "one rank checked there; no replicas to compare") in report.summary(), report.summary()
    assert report.matched == len(NAMES) * STEPS


@pytest.mark.slow
def test_resume_per_rank_with_the_same_world_size_and_not_another(job):
    folder, results = job
    path = os.path.join(folder, "resume.h5")
    for rank in (0, 1):
        with upd.open_run(rank_path(path, rank, 2)) as run:
            assert list(run.optimizers[0].steps) == list(range(2 * STEPS))  # each rank continued its own file
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH, report.summary()
    assert report.matched == 2 * len(NAMES) * 2 * STEPS

    for result in results:
        message = result["refused"]
        assert "cannot resume" in message and "job of 3 processes, this job has 2" in message
    larger = os.path.join(folder, "larger.h5")
    assert rank_files(larger)[0] == 3  # nothing written for the 2-process job
    assert not os.path.exists(rank_path(larger, 0, 2)) and not os.path.exists(rank_path(larger, 1, 2))


# -- a rank killed mid-run -------------------------------------------------------------------------------------------
KILLED_AFTER = 3  # steps rank 1 completes before it SIGKILLs itself


def _kill_entry(rank: int, world_size: int, port: int, folder: str) -> None:
    """Like tests.harness.distributed's entry, but a job one of whose ranks dies is the point here."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = DDP(MLP())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def after_step(i):
        if rank == 1 and i + 1 == KILLED_AFTER:
            # The writer thread commits what it holds first (a kill inside a write: tests/reliability). A fixed
            # pause was too short on a loaded machine (no step committed), so wait for the writes themselves.
            deadline = time.monotonic() + 60
            while rec._writer.records_written < KILLED_AFTER and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

    with upd.record(os.path.join(folder, "killed.h5"), model, opt, ranks="all", every=1) as rec:
        try:
            train_steps(model, opt, steps=3 * KILLED_AFTER, seed=rank, after_step=after_step)
        except RuntimeError:
            pass  # the peer is gone: the next all-reduce fails, the recorder closes its file as usual


@pytest.mark.slow
def test_a_rank_killed_mid_run_leaves_the_other_files_intact(tmp_path):
    mp.set_forkserver_preload(PRELOAD)  # forked from the harness's forkserver: no rank imports torch again
    ctx = mp.get_context("forkserver")
    port = free_port()
    processes = [ctx.Process(target=_kill_entry, args=(rank, 2, port, str(tmp_path))) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=90)
    assert processes[1].exitcode == -signal.SIGKILL
    assert processes[0].exitcode == 0
    _, files = rank_files(str(tmp_path / "killed.h5"))
    with upd.open_run(files[0]) as survivor:
        assert survivor.meta[schema.META_DISTRIBUTED]["rank"] == 0
        assert list(survivor.optimizers[0].steps) == list(range(KILLED_AFTER))
        assert upd.verify(survivor).exit_code == EXIT_MATCH
    with upd.open_run(files[1]) as killed:  # readable up to its last committed record
        committed = list(killed.optimizers[0].steps)
        assert committed == list(range(len(committed))) and 0 < len(committed) <= KILLED_AFTER
    with upd.open_run(str(tmp_path / "killed.h5")) as job:  # the job: the steps both files completed
        assert list(job.optimizers[0].steps) == committed
        assert job.missing_ranks == ({1: list(range(len(committed), KILLED_AFTER))}
                                     if len(committed) < KILLED_AFTER else {})
        assert upd.verify(job).exit_code == EXIT_MATCH


# -- the decisions, without a job ------------------------------------------------------------------------------------
def test_recording_ranks():
    assert distributed.recording_ranks(None, 4, split=False) == [0]
    assert distributed.recording_ranks(None, 4, split=True) == "all"
    assert distributed.recording_ranks("all", 4, split=False) == "all"
    assert distributed.recording_ranks(2, 4, split=True) == [2]
    for bad in (4, -1, "some", True, [0, 1]):
        with pytest.raises(ValueError, match="ranks"):
            distributed.recording_ranks(bad, 4, split=False)


def test_files_of_each_setup():
    setup = distributed.RankSetup(rank=1, world_size=2, recording_ranks=[0], parallelism="ddp", job_path="r/x.h5")
    assert not setup.records and setup.single_file
    setup = distributed.RankSetup(rank=1, world_size=2, recording_ranks="all", parallelism="ddp", job_path="r/x.h5")
    assert setup.records and setup.file == "r/x.rank1-of-2.h5"
    setup = distributed.RankSetup(rank=0, world_size=2, recording_ranks=[0], parallelism="ddp", job_path="r/x.h5")
    assert setup.file == "r/x.h5"
    setup = distributed.RankSetup(rank=1, world_size=2, recording_ranks=[1], parallelism="ddp", job_path="r/x.h5")
    assert setup.records and setup.file == "r/x.rank1-of-2.h5"  # the path itself is rank 0's alone


def test_layout_conflicts(tmp_path):
    path = str(tmp_path / "x.h5")

    def setup(world, recording):
        return distributed.RankSetup(rank=0, world_size=world, recording_ranks=recording, parallelism="ddp",
                                     job_path=path)

    assert distributed.layout_conflict(setup(2, "all")) is None
    open(rank_path(path, 0, 2), "w").close()
    assert distributed.layout_conflict(setup(2, "all")) is None  # the same job's files: resume or overwrite decide
    assert "job of 2 processes, this job has 3" in distributed.layout_conflict(setup(3, "all"))
    assert "records on rank 0 only" in distributed.layout_conflict(setup(2, [0]))
    os.remove(rank_path(path, 0, 2))
    open(path, "w").close()
    assert "one file each" in distributed.layout_conflict(setup(2, "all"))
    assert distributed.layout_conflict(setup(2, [0])) is None


def test_ranks_outside_a_distributed_job_is_checked_and_otherwise_ignored(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="ranks"):
        upd.record(str(tmp_path / "bad.h5"), model, opt, ranks="some", every=1)
    with upd.record(str(tmp_path / "x.h5"), model, opt, ranks="all", every=1) as rec:
        train_steps(model, opt, steps=1)
    assert rec.rank_setup is None and rec.records == 1
    with upd.open_run(str(tmp_path / "x.h5")) as run:
        assert "distributed" not in run.meta


@pytest.mark.slow
def test_info_says_a_ddp_file_recorded_by_rank_0_is_the_whole_job(job):
    from click.testing import CliRunner
    from upd.cli.main import main

    folder, _ = job
    path = os.path.join(folder, "ddp.h5")
    out = CliRunner().invoke(main, ["info", path]).output
    assert "this file is the whole job" in out, out
    assert "the whole job: upd info" not in out and "that rank's part" not in out
    replica = rank_path(os.path.join(folder, "replicas.h5"), 1, 2)  # ranks="all": each file one replica's part
    out = CliRunner().invoke(main, ["info", replica]).output
    assert "this file holds that rank's part; the whole job: upd info" in out, out
