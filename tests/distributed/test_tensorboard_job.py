"""Live TensorBoard in a distributed job (upd.record(..., tensorboard=DIR) on every rank): rank 0 alone writes, the
global ratios and norms, at the cost of one small all-reduce per statistics step in a split job (FSDP2, ZeRO) and
none in a replicated one; a recorder error on one rank stops the scalars on every rank and never hangs training.

The combining math is tested on its own first (shards of known tensors); then one real job of 2 gloo processes
(tests.harness.distributed) records every configuration, counting torch.distributed.all_reduce calls in each
process, and the event files are read back with TensorBoard's own reader.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import upd
from tests.harness.distributed import run_job
from tests.harness.training import MLP, train_steps
from upd.integrations.tensorboard import TAGS
from upd.ratios import grad_to_data, update_to_data
from upd.recorder import distributed
from upd.recorder.device_stats import STATS, stats_rows
from upd.sinks.feed import SINKS_JOB, SINKS_OWN
from upd.recorder.job_scalars import FIELDS, KINDS, JobScalars, Slot, contribution, scalars
from upd.runfile.ranks import rank_path

# -- the combining math, on one process -------------------------------------------------------------------------------


def _recorded(tensors: dict) -> dict:
    """{"<kind>_<stat>": value} as the recorder's device statistics give them for one part."""
    out = {}
    for kind, t in tensors.items():
        row = stats_rows([t])[0].tolist()
        out.update({f"{kind}_{stat}": v for stat, v in zip(STATS, row)})
    return out


def _whole_scalars(param, grad, update) -> dict:
    p, g, u = (t.double().reshape(-1) for t in (param, grad, update))
    return {"update_to_data": float(update_to_data(u.std(), p.std())),
            "grad_to_data": float(grad_to_data(g.std(), p.std())),
            "update_norm": float(u.norm()), "grad_norm": float(g.norm()), "param_norm": float(p.norm())}


def _tensors(seed: int, shape: tuple, mean: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    param = mean + 0.02 * torch.randn(shape, generator=g)  # |mean| >> std for a norm layer's scale
    return {"param": param, "grad": torch.randn(shape, generator=g), "update": 1e-3 * torch.randn(shape, generator=g)}


# Row splits of each parameter over 3 "ranks": uneven, one-element parts, and a rank that holds no part.
SPLITS = {"w": ((7, 3), 0.0, [3, 3, 1]), "scale": ((2,), 1.0, [1, 1, 0]), "b": ((5, 2), 0.1, [2, 3, 0])}


def _sums_over_ranks(drop_rank: int | None = None) -> tuple[list[Slot], np.ndarray, dict]:
    slots = [Slot(name, name) for name in SPLITS]
    whole, total = {}, 0
    parts_by_rank = [{} for _ in range(3)]
    for seed, (name, (shape, mean, split)) in enumerate(SPLITS.items()):
        tensors = _tensors(seed, shape, mean)
        whole[name] = _whole_scalars(**tensors)
        start = 0
        for rank, n in enumerate(split):
            part = {kind: t[start:start + n] for kind, t in tensors.items()}
            if n:
                parts_by_rank[rank][name] = (part["param"].numel(), _recorded(part))
            start += n
    for rank, parts in enumerate(parts_by_rank):
        if rank != drop_rank:
            total = total + contribution(slots, parts)
    return slots, total, whole


def test_parts_summed_over_ranks_give_the_whole_parameters_scalars():
    """Every TensorBoard column of every parameter, from its parts' recorded statistics added over ranks, equals
    that of the whole tensor: uneven parts, parts of one element (no spread of their own), a rank holding no
    part, and a weight whose mean is 50 times its spread."""
    slots, total, whole = _sums_over_ranks()
    assert total.shape == (len(slots) * len(KINDS) * len(FIELDS),)
    got = scalars(slots, total)
    assert sorted(got) == sorted(whole)
    for name, columns in whole.items():
        assert list(got[name]) == list(TAGS)
        for tag in TAGS:
            # float32 statistics on the device: ~1e-6 relative, far below the 1e-4 the job test asks
            assert got[name][tag] == pytest.approx(columns[tag], rel=2e-5, abs=2e-5), (name, tag)


def test_a_missing_part_gives_other_scalars():
    """The check above can fail: without rank 1's parts the sums are those of other tensors."""
    slots, total, whole = _sums_over_ranks(drop_rank=1)
    got = scalars(slots, total)
    assert abs(got["w"]["update_to_data"] - whole["w"]["update_to_data"]) > 1e-3
    assert abs(got["w"]["param_norm"] - whole["w"]["param_norm"]) > 1e-3
    assert math.isnan(got["scale"]["update_to_data"])  # one element left: no std


def test_nan_in_a_part_gives_no_scalar_and_an_absent_parameter_gives_nan():
    slots = [Slot("w", "w"), Slot("opt1:v", "v")]
    part = _recorded({"param": torch.ones(4), "grad": torch.tensor([1.0, float("nan"), 0.0, 2.0]),
                      "update": torch.full((4,), 1e-3)})
    got = scalars(slots, contribution(slots, {"w": (4, part)}))
    assert math.isnan(got["w"]["grad_to_data"]) and math.isnan(got["w"]["grad_norm"])
    assert got["w"]["param_norm"] == pytest.approx(2.0)
    assert all(math.isnan(v) for v in got["opt1:v"].values())  # no rank held a part: nothing to write


def _setup(rank=0, recording="all", parallelism="fsdp", split=True):
    return distributed.RankSetup(rank=rank, world_size=2, recording_ranks=recording, parallelism=parallelism,
                                 job_path="r/x.h5", split=split)


def test_who_feeds_the_sinks_in_a_job():
    role = distributed.sink_role
    assert role(None) == SINKS_OWN  # one process
    assert role(_setup(0)) == role(_setup(1)) == SINKS_JOB  # FSDP2 / ZeRO on every rank
    assert role(_setup(0, parallelism="zero")) == SINKS_JOB
    for parallelism in ("ddp", "replicated"):  # replicas: rank 0's statistics are the job's, no collective
        assert role(_setup(0, "all", parallelism, False)) == role(_setup(0, [0], parallelism, False)) == "own"
        assert role(_setup(1, "all", parallelism, False)) == role(_setup(1, [0], parallelism, False)) == "none"
        assert role(_setup(1, [1], parallelism, False)) == "own"
    with pytest.raises(ValueError, match="need every rank of this job recording"):
        role(_setup(0, [0]))


def test_which_parts_count_toward_the_whole():
    """Plain tensors: a copy on every rank counts once (rank 0), a ZeRO partition on the rank that steps it."""
    t = torch.zeros(3)
    assert distributed.counts_toward_whole(t, _setup(0)) and not distributed.counts_toward_whole(t, _setup(1))
    assert distributed.counts_toward_whole(t, _setup(1, parallelism="zero"))


class _FakeGroup:
    """rank 0's side of a 2-rank all-reduce: adds what rank 1 sends, given per call."""

    def __init__(self, monkeypatch, rank1_vectors):
        self.calls = 0
        self.rank1 = iter(rank1_vectors)
        monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
        monkeypatch.setattr(torch.distributed, "all_reduce", self.all_reduce)

    def all_reduce(self, tensor, *args, **kwargs):
        self.calls += 1
        tensor += torch.from_numpy(next(self.rank1)(len(tensor)))


def _rank1(ok: bool):
    def vector(length):
        v = np.zeros(length)
        v[1] = 1.0 if ok else 0.0  # the flags come first: one per rank
        return v
    return vector


def test_a_stopped_rank_stops_every_rank_at_the_next_statistics_step(monkeypatch):
    """Rank 0 with stats_every=2: all-reduces at steps 0, 2, 4 only; rank 1 reports at step 2 that it stopped, so
    rank 0 returns nothing for it, warns naming rank 1, and joins no more (nor does rank 1: it reads the same
    flags)."""
    group = _FakeGroup(monkeypatch, [_rank1(True), _rank1(False)])
    said = []
    slots = [Slot("w", "w")]
    job = JobScalars(0, 2, 2, [0], lambda k: slots, said.append)
    part = (4, _recorded({"param": torch.arange(4.0), "grad": torch.ones(4), "update": torch.arange(4.0) / 1e3}))
    results = [job.after_step(0, (step, {"w": part})) for step in range(6)]
    assert group.calls == 2 and job.all_reduces == 2
    assert results[0][0] == 0 and results[0][1] == slots and results[1] is None
    assert scalars(slots, results[0][2])["w"]["update_to_data"] == pytest.approx(-3.0, abs=1e-6)
    assert results[2:] == [None] * 4
    assert said == ["recording stopped on rank 1 at step 2"] and job.stopped == said[0]


def test_a_rank_without_its_statistics_joins_with_zeros(monkeypatch):
    """Rank 1's recording stopped: it still joins, with zeros and no flag (the all-reduce here sends rank 1's
    tensor and receives nothing, so rank 0's flag is missing too); it stops and leaves the telling to rank 0."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    sent = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: sent.append(t.clone()))
    said = []
    job = JobScalars(1, 2, 1, [5], lambda k: [Slot("w", "w")], said.append)
    assert job.after_step(0, None) is None
    assert sent[0].tolist() == [0.0] * (2 + len(KINDS) * len(FIELDS)) and job.stopped
    assert job.after_step(0, None) is None and len(sent) == 1 and said == []


def test_a_failed_all_reduce_stops_joining_with_one_warning(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")

    def broken(tensor):
        raise RuntimeError("connection reset by peer")
    monkeypatch.setattr(torch.distributed, "all_reduce", broken)
    said = []
    job = JobScalars(0, 2, 1, [0], lambda k: [Slot("w", "w")], said.append)
    assert job.after_step(0, (0, {})) is None and job.after_step(0, (1, {})) is None
    assert len(said) == 1 and "all-reduce" in said[0] and "connection reset" in said[0]


# -- a real job -------------------------------------------------------------------------------------------------------
STEPS = 4
FAIL_STEP = 1
GLOBAL_BATCH = 4


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))  # 7 rows: 4 + 3; 2 rows: 1 + 1
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_fsdp(model, optimizer, rank: int, world: int) -> None:
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)
        optimizer.zero_grad()
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()


def _fail_at(rec, step: int) -> None:
    """Make this rank's recorder fail (as a full disk would) while computing the statistics of `step`."""
    after_step = rec._after_step

    def failing(track):
        if track.steps_done == step:  # the step about to be recorded
            raise OSError("injected: no space left on device")
        return after_step(track)
    rec._after_step = failing


def _run_config(config: str, rank: int, world: int, folder: str, mesh) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from upd.recorder import recorder as recorder_module

    path, logdir = os.path.join(folder, f"{config}.h5"), os.path.join(folder, "tb", config)
    setup, _, options = config.partition("_")
    if setup == "fsdp":
        model = _fsdp_model(mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        train = lambda: _train_fsdp(model, optimizer, rank, world)  # noqa: E731
    else:
        torch.manual_seed(0)
        model = DDP(MLP())
        optimizer = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
                     if setup == "zero" else torch.optim.Adam(model.parameters(), lr=1e-2))
        train = lambda: train_steps(model, optimizer, steps=STEPS, seed=rank)  # noqa: E731
    if options == "unrecorded":
        train()
        return {}
    kwargs = {"every": None, "stats_every": 2 if options == "tb-every-2" else 1, "ranks": None}
    if options.startswith("tb"):
        kwargs["tensorboard"] = logdir
    if options == "tb-one-rank":
        try:
            upd.record(path, model, optimizer, ranks=0, **{k: v for k, v in kwargs.items() if k != "ranks"})
        except ValueError as exc:
            return {"refused": str(exc)}
        return {"refused": None}
    if setup == "ddp":
        kwargs["ranks"] = "all"
    writer_class = recorder_module.AsyncRunWriter
    if options == "tb-no-file" and rank == 1:
        def no_file(path, *args, **kwargs):
            raise PermissionError(13, "Permission denied", path)
        recorder_module.AsyncRunWriter = no_file
    try:
        with upd.record(path, model, optimizer, **{"every": 1, **kwargs}) as rec:
            if options == "tb-fails" and rank == 1:
                _fail_at(rec, FAIL_STEP)
            train()
    finally:
        recorder_module.AsyncRunWriter = writer_class
    return {"active_at_end": rec.error is None}


CONFIGS = ["fsdp_unrecorded", "fsdp_stats", "fsdp_tb", "fsdp_tb-every-2", "fsdp_tb-fails", "fsdp_tb-no-file",
           "fsdp_tb-one-rank", "zero_unrecorded", "zero_tb", "ddp_unrecorded", "ddp_tb"]


def job_worker(rank: int, world_size: int, folder: str) -> dict:
    """Every configuration in one job, counting this process's torch.distributed.all_reduce calls in each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", message=".*TorchScript.*")  # ZeroRedundancyOptimizer's import
    mesh = init_device_mesh("cpu", (world_size,))
    real_all_reduce, calls = dist.all_reduce, []

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return real_all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = counting
    results = {"pid": os.getpid()}
    try:
        for config in CONFIGS:
            before = len(calls)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", upd.RecorderWarning)
                result = _run_config(config, rank, world_size, folder, mesh)
            dist.barrier()
            results[config] = {**result, "all_reduces": len(calls) - before,
                               "warnings": [str(w.message) for w in caught
                                            if issubclass(w.category, upd.RecorderWarning)]}
    finally:
        dist.all_reduce = real_all_reduce
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tbjob"))
    return folder, run_job(job_worker, 2, folder, timeout=150)


def read_scalars(logdir) -> dict:
    """{tag: {step: value}} as TensorBoard reads the event files (no sampling)."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _event_files(folder: str, config: str) -> list[str]:
    logdir = os.path.join(folder, "tb", config)
    return sorted(os.listdir(logdir)) if os.path.isdir(logdir) else []


def _extra_all_reduces(results, config: str, baseline: str) -> list[int]:
    """Per rank: the all-reduces `config` made beyond the same training unrecorded."""
    return [r[config]["all_reduces"] - r[baseline]["all_reduces"] for r in results]


def assert_scalars_are_the_jobs_ratios(logdir: str, path: str, steps: list[int]) -> None:
    """Every TAGS column of every parameter at each of `steps` equals the job's ratios (1e-4), and nothing else
    was written."""
    got = read_scalars(logdir)
    with upd.open_run(path) as job:
        ratios = job.ratios()
    expected = {}
    for r in ratios.itertuples():
        for column in TAGS:
            value = getattr(r, column)
            if int(r.step) in steps and math.isfinite(value):
                expected.setdefault(f"{column}/{r.param}", {})[int(r.step)] = value
    assert sorted(got) == sorted(expected) and len(got) == len(TAGS) * ratios["param"].nunique()
    for tag, points in expected.items():
        assert sorted(got[tag]) == steps, tag
        for step, value in points.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-4, abs=1e-4), (tag, step)


@pytest.mark.slow
def test_fsdp_rank_0_alone_writes_the_global_ratios_with_one_all_reduce_per_statistics_step(job):
    folder, results = job
    config = "fsdp_tb"
    assert results[0][config]["warnings"] == results[1][config]["warnings"] == []
    # No collective without tensorboard=; one per statistics step with it, on each rank, of float64 sums.
    assert _extra_all_reduces(results, "fsdp_stats", "fsdp_unrecorded") == [0, 0]
    assert _extra_all_reduces(results, config, "fsdp_unrecorded") == [STEPS, STEPS]
    assert _extra_all_reduces(results, "fsdp_tb-every-2", "fsdp_unrecorded") == [STEPS // 2, STEPS // 2]
    files = _event_files(folder, config)
    assert len(files) == 1 and f".{results[0]['pid']}." in files[0]  # rank 0's; none from rank 1
    path = os.path.join(folder, "fsdp_tb.h5")
    assert_scalars_are_the_jobs_ratios(os.path.join(folder, "tb", config), path, list(range(STEPS)))
    assert_scalars_are_the_jobs_ratios(os.path.join(folder, "tb", "fsdp_tb-every-2"),
                                       os.path.join(folder, "fsdp_tb-every-2.h5"), [0, 2])


@pytest.mark.slow
def test_the_global_ratios_are_not_rank_0s_own(job):
    """The comparison above can fail: rank 0's own shard statistics (what each rank wrote before) differ from the
    parameters' by far more than its tolerance."""
    folder, _ = job
    got = read_scalars(os.path.join(folder, "tb", "fsdp_tb"))
    with upd.open_run(rank_path(os.path.join(folder, "fsdp_tb.h5"), 0, 2)) as run:
        own = run.stats().set_index(["param", "step"])
    assert max(abs(got[f"update_to_data/{name}"][0] - own.loc[(name, 0), "update_to_data"])
               for name in ("0.weight", "2.weight")) > 1e-2
    assert max(abs(got[f"param_norm/{name}"][0] - own.loc[(name, 0), "param_norm"])
               for name in ("0.weight", "2.weight")) > 1e-2


@pytest.mark.slow
def test_a_recorder_error_on_one_rank_stops_the_scalars_everywhere_without_a_hang(job):
    """Rank 1's recording fails at step 1: it joins that step's all-reduce with nothing, every rank stops joining,
    rank 0 keeps the scalars of step 0 and says why; training ran to the end on both (the job finished)."""
    folder, results = job
    config = "fsdp_tb-fails"
    assert _extra_all_reduces(results, config, "fsdp_unrecorded") == [FAIL_STEP + 1, FAIL_STEP + 1]
    assert results[0][config]["warnings"] == [f"torch-upd: the job's live statistics stop: recording "
                                              f"stopped on rank 1 at step {FAIL_STEP}; training continues."]
    assert len(results[1][config]["warnings"]) == 1 and "injected" in results[1][config]["warnings"][0]
    assert results[0][config]["active_at_end"] and not results[1][config]["active_at_end"]
    got = read_scalars(os.path.join(folder, "tb", config))
    assert got and all(sorted(points) == [0] for points in got.values())


@pytest.mark.slow
def test_a_rank_that_cannot_create_its_file_still_joins_once(job):
    folder, results = job
    config = "fsdp_tb-no-file"
    assert _extra_all_reduces(results, config, "fsdp_unrecorded") == [1, 1]
    assert "cannot record to" in results[1][config]["warnings"][0]
    assert results[0][config]["warnings"] == ["torch-upd: the job's live statistics stop: recording "
                                              "stopped on rank 1 at step 0; training continues."]
    assert read_scalars(os.path.join(folder, "tb", config)) == {}


@pytest.mark.slow
def test_tensorboard_on_one_rank_of_a_sharded_job_is_refused_on_every_rank(job):
    _, results = job
    for r in results:
        assert "(sinks=, tensorboard=) need every rank of this job recording" in r["fsdp_tb-one-rank"]["refused"]


@pytest.mark.slow
def test_zero_partitions_are_combined_from_the_rank_that_steps_each(job):
    folder, results = job
    assert _extra_all_reduces(results, "zero_tb", "zero_unrecorded") == [STEPS, STEPS]
    files = _event_files(folder, "zero_tb")
    assert len(files) == 1 and f".{results[0]['pid']}." in files[0]
    assert_scalars_are_the_jobs_ratios(os.path.join(folder, "tb", "zero_tb"), os.path.join(folder, "zero_tb.h5"),
                                       list(range(STEPS)))


@pytest.mark.slow
def test_replicas_need_no_collective_and_rank_0_writes(job):
    """DDP with ranks="all": every replica records, rank 0 alone writes its own statistics (they are the job's)."""
    folder, results = job
    assert _extra_all_reduces(results, "ddp_tb", "ddp_unrecorded") == [0, 0]
    files = _event_files(folder, "ddp_tb")
    assert len(files) == 1 and f".{results[0]['pid']}." in files[0]
    assert_scalars_are_the_jobs_ratios(os.path.join(folder, "tb", "ddp_tb"), os.path.join(folder, "ddp_tb.h5"),
                                       list(range(STEPS)))
