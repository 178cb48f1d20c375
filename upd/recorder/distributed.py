"""Where a recorder sits in a torch.distributed job: which ranks record, which file each writes, and what kind of
parallelism the job uses.

The same ``upd.record(path, ...)`` call runs on every rank. Each recording rank writes its own file (named by
``upd.runfile.ranks``), so no rank waits on another and no collective enters the training step; everything here is
decided locally from the process group, the model and the optimizer. The one exception is opt-in: live sinks
(``sinks=``, ``tensorboard=``) in a job whose ranks each hold a part of the model join one small all-reduce per
statistics step (``sink_role``, ``job_scalars``). Replicated training (DDP, or a model copied to every rank) records on
rank 0 alone by default, into ``path`` itself: the replicas are identical.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..runfile import schema
from ..runfile.ranks import rank_files, rank_path
from ..sinks.feed import SINKS_JOB, SINKS_NONE, SINKS_OWN
from . import wrappers


def process_group() -> tuple[int, int] | None:
    """(rank, world size) of the initialised default process group when it has more than one process, else None."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    world = torch.distributed.get_world_size()
    return (torch.distributed.get_rank(), world) if world > 1 else None


def recording_ranks(ranks, world_size: int, split: bool):
    """``ranks=`` resolved: "all" or the sorted list of ranks that record. None picks every rank for split
    training and rank 0 for replicated training."""
    if ranks is None:
        return schema.ALL_RANKS if split else [0]
    if ranks == schema.ALL_RANKS:
        return schema.ALL_RANKS
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        if not 0 <= ranks < world_size:
            raise ValueError(f"ranks={ranks} is not a rank of this job (world size {world_size})")
        return [ranks]
    raise ValueError(f"ranks= takes None (automatic), 'all' or one rank number, got {ranks!r}")


def check_ranks_option(ranks) -> None:
    """ranks= outside a distributed job: checked for its type all the same, so a typo fails on one process too."""
    if ranks is None or ranks == schema.ALL_RANKS or (isinstance(ranks, int) and not isinstance(ranks, bool)
                                                      and ranks >= 0):
        return
    raise ValueError(f"ranks= takes None (automatic), 'all' or one rank number, got {ranks!r}")


@dataclass(frozen=True)
class RankSetup:
    """This process's part in a distributed recording."""

    rank: int
    world_size: int
    recording_ranks: object  # "all" or a list of ranks
    parallelism: str
    job_path: str
    split: bool = False  # each rank holds or steps a part of the model (wrappers.splits)
    recorded_weights: str | None = None  # what this rank records when not the model's own weights

    @property
    def records(self) -> bool:
        return self.recording_ranks == schema.ALL_RANKS or self.rank in self.recording_ranks

    @property
    def single_file(self) -> bool:
        """Only rank 0 records: it writes the job's path itself, a plain single-file run."""
        return self.recording_ranks == [0]

    @property
    def file(self) -> str:
        """The file this rank writes."""
        return self.job_path if self.single_file else rank_path(self.job_path, self.rank, self.world_size)

    def meta(self) -> dict:
        """The root metadata's "distributed" entry (docs/format.md)."""
        meta = {"rank": self.rank, "world_size": self.world_size, "recording_ranks": self.recording_ranks,
                "parallelism": self.parallelism, "job_path": self.job_path}
        if self.recorded_weights is not None:
            meta[schema.META_RECORDED_WEIGHTS] = self.recorded_weights
        return meta


def setup(path: str, models: list, optimizers, ranks) -> RankSetup | None:
    """This process's RankSetup in an initialised process group of several processes, else None (``ranks=`` is
    only checked then). `models`: the model as the user passed it and each module inside its wrappers
    (``wrappers.model_chain``); `optimizers` the job's (ZeRO wrappers included)."""
    group = process_group()
    if group is None:
        check_ranks_option(ranks)
        return None
    rank, world = group
    split = wrappers.splits(models, optimizers)
    used = wrappers.in_use(models, optimizers)
    weights = next((w.recorded_weights for w in used if w.recorded_weights is not None), None)
    return RankSetup(rank=rank, world_size=world, recording_ranks=recording_ranks(ranks, world, split),
                     parallelism=used[0].parallelism, job_path=os.fspath(path), split=split,
                     recorded_weights=weights)


def sink_role(rank_setup: RankSetup | None) -> str:
    """This rank's part in the live sinks (``sinks=``, ``tensorboard=``): SINKS_OWN, it feeds its sinks its own
    statistics (they are the whole parameters': one process, or the writing rank of replicated training: rank 0
    when every replica records); SINKS_JOB, every rank of a split job joins one all-reduce per statistics step and
    rank 0 feeds its sinks the combined statistics (``job_scalars``); SINKS_NONE, it feeds none.

    ValueError when a split job records on one rank only: its shards' statistics are not the parameters'."""
    if rank_setup is None:
        return SINKS_OWN
    if rank_setup.split:
        if rank_setup.recording_ranks != schema.ALL_RANKS:
            raise ValueError(f"live sinks (sinks=, tensorboard=) need every rank of this job recording (ranks=None "
                             f"or 'all'): each rank holds a part of the model, and rank "
                             f"{rank_setup.recording_ranks[0]}'s parts alone do not give the parameters' ratios")
        return SINKS_JOB
    if not rank_setup.records:
        return SINKS_NONE
    writer = 0 if rank_setup.recording_ranks == schema.ALL_RANKS else rank_setup.recording_ranks[0]
    return SINKS_OWN if rank_setup.rank == writer else SINKS_NONE


def counts_toward_whole(tensor, rank_setup: RankSetup) -> bool:
    """Whether this rank's statistics of `tensor` (a recorded parameter's part) are added into the job's whole
    parameter, so that every element is added once (``wrappers.counts_toward_whole``: the kind that owns
    the tensor says; a copy on every rank counts on rank 0)."""
    return wrappers.counts_toward_whole(tensor, rank_setup.rank, rank_setup.parallelism)


def layout_conflict(rank_setup: RankSetup) -> str | None:
    """Why this rank must not write its file next to the files already there, or None.

    A job's files are found from its path alone (``upd.runfile.ranks.rank_files``): rank files of another world
    size, or a single-file run where rank files go (or the reverse), would leave a job that reads as the other
    one or not at all. Resuming cannot continue them either: each rank's file holds its own part of the job."""
    path = rank_setup.job_path
    try:
        world, files = rank_files(path)
    except ValueError as exc:
        return str(exc)
    if files and world != rank_setup.world_size:
        return (f"the existing rank files of {path} ({', '.join(os.path.basename(f) for f in files.values())}) "
                f"are of a job of {world} processes, this job has {rank_setup.world_size}; a job resumes on the "
                "same number of processes only. Record to a new path, or move those files away")
    if files and rank_setup.single_file:
        return (f"rank files of an earlier job of {world} processes exist for {path} "
                f"({', '.join(os.path.basename(f) for f in files.values())}); this job records on rank 0 only, "
                "into the path itself. Record to a new path, or move those files away")
    if not rank_setup.single_file and os.path.exists(path):
        return (f"{path} holds a run recorded on one rank; this job records on several ranks, into one file each, "
                "which that file would hide from readers. Record to a new path, or move it away")
    return None
