"""Opening a run by its path: one file (a Run), or the rank files of a distributed job (a Job).

Above both ``reader`` and ``job``, which builds on the reader: neither imports this module.
"""
from __future__ import annotations

import os

from .reader import Run


def open_run(path, live_timeout: float | None = None):
    """Open a recorded run for reading: a ``Run``, or a ``Job`` for the path of a distributed job. Raises
    RunFileError (one clear line) for anything that is not a usable run.

    A job's path names no file itself: each recording rank wrote its own, named from it (``runfile.ranks``). When
    `path` does not exist but such rank files do, the returned ``upd.runfile.job.Job`` reads them all as one run
    (see docs/format.md, "Distributed jobs"); a rank's file can also be opened on its own, as a plain Run.

    A run that is still being written is read from a copy taken between two records (``run.live`` is True): it
    holds every record committed so far and never a half-written one. Waiting for the writer to finish the record
    in progress is bounded by `live_timeout` seconds (default: $UPD_LIVE_TIMEOUT, else 30); open the run again to
    see records committed later. The copy lives in the temporary folder (``TMPDIR``) until
    the run is closed.
    """
    if not os.path.exists(os.fspath(path)):
        from .job import Job, is_job_path  # job.py imports torch, which opening one file never needs

        if is_job_path(path):
            return Job(path, live_timeout=live_timeout)
    return Run(path, live_timeout=live_timeout)
