"""The run's metadata (the file's ``meta`` attribute) as the recorder writes it when the file is created."""
from __future__ import annotations

import platform
import sys
import time

import torch

from .. import __version__
from ..runfile import schema


def run_meta(stored_options: dict, optimizer_count: int, rank_setup) -> dict:
    """Versions, platform, creation time, command line and the stored options (``RecordOptions.stored``); in a
    distributed job also the rank's place in it (``distributed.RankSetup.meta``). Each optimizer's entry is added
    by the writer (``OptimizerTrack.meta``)."""
    meta = {
        "upd_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "created_unix": time.time(),
        "argv": list(sys.argv),
        "options": stored_options,
        "optimizer_count": optimizer_count,
    }
    if rank_setup is not None:
        meta[schema.META_DISTRIBUTED] = rank_setup.meta()
    return meta
