"""How a distributed job's run is spread over files: one file per recording rank, named from the job's path.

Each rank writes its own file, so no rank waits on another and no collective enters the training step. The names
are derived from the path the user gave ``upd.record`` (docs/format.md, "Distributed jobs"):

    runs/exp1.h5  ->  runs/exp1.rank0-of-4.h5, runs/exp1.rank1-of-4.h5, ...

The world size is part of every name, so a reader given the job's path finds every file and knows which are missing.
A job that records on one rank only (replicated training such as DDP, by default) writes the path itself.
"""
from __future__ import annotations

import os
import re

# The one name of each rank: ASCII digits without leading zeros, as rank_path writes it. Any other spelling
# (rank00-of-02, digits of another script) is not a rank file: two names for one rank would make the job depend on
# the order a folder lists its files.
_RANK_SUFFIX = re.compile(r"\.rank(0|[1-9][0-9]*)-of-([1-9][0-9]*)$")


def rank_path(path: str, rank: int, world_size: int) -> str:
    """The file rank `rank` of a job of `world_size` processes writes for the job path `path`."""
    stem, ext = os.path.splitext(os.fspath(path))
    return f"{stem}.rank{rank}-of-{world_size}{ext}"


def rank_files(path: str) -> tuple[int, dict[int, str]]:
    """(world size, {rank: file}) of the rank files that exist for the job path `path`; (0, {}) when there are none.

    Files of two different world sizes for one path (a job restarted on another number of processes, into the same
    path) are ambiguous, and a rank file that is a symlink is not followed: ValueError names them."""
    path = os.fspath(path)
    stem, ext = os.path.splitext(path)
    folder = os.path.dirname(path) or "."
    prefix = os.path.basename(stem)
    found: dict[int, dict[int, str]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return 0, {}
    for name in names:
        if not (name.startswith(prefix) and name.endswith(ext)):
            continue
        match = _RANK_SUFFIX.fullmatch(name[len(prefix):len(name) - len(ext)] if ext else name[len(prefix):])
        if match:
            rank, world = int(match.group(1)), int(match.group(2))
            if rank < world:
                file = os.path.join(os.path.dirname(path), name)
                if os.path.islink(file):  # derived from the job's path, not typed by the user: never followed
                    raise ValueError(f"{file}: a rank file of {path} is a symbolic link, which is never followed; "
                                     "open it by its own name to read that file alone")
                found.setdefault(world, {})[rank] = file
    if len(found) > 1:
        raise ValueError(f"{path}: rank files of several world sizes ({', '.join(map(str, sorted(found)))}); "
                         "move the files of the other job away")
    if not found:
        return 0, {}
    world = next(iter(found))
    return world, dict(sorted(found[world].items()))
