"""What ``upd record`` hands to the processes it starts: the environment variable with the recording options, the
bootstrap directory on ``PYTHONPATH``, and the names of the files a launched run may write.

The launcher and every process of the command agree through this module alone. It imports nothing heavy: the
bootstrap reads the variable in every Python process the command starts, most of which never train.
"""
from __future__ import annotations

import json
import os
import re

# The recording request: JSON {"path": absolute RUN, "options": upd.record's keyword arguments}. Its presence is what
# makes the bootstrap hook a process; an empty value is the same as none.
ENV_VAR = "UPD_RECORD"
CONFIG_VERSION = 1

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")

# Optimizers that a process creates after the first ones have started stepping are recorded into further parts of
# the run: RUN for the first group, then <stem>.part2<ext>, <stem>.part3<ext>, ...
_PART = "part"


def encode(path: str, options: dict) -> str:
    return json.dumps({"version": CONFIG_VERSION, "path": os.path.abspath(path), "options": options})


def decode(value: str) -> tuple[str, dict]:
    """(RUN, options) from the variable's value; ValueError for anything this version did not write."""
    config = json.loads(value)
    if not isinstance(config, dict) or config.get("version") != CONFIG_VERSION:
        raise ValueError(f"{ENV_VAR} holds no recording request of this torch-upd version")
    path, options = config.get("path"), config.get("options")
    if not isinstance(path, str) or not isinstance(options, dict):
        raise ValueError(f"{ENV_VAR} lacks the run's path or its options")
    return path, options


def child_environment(path: str, options: dict, environ=None) -> dict:
    """The environment the command runs in: `environ` (default: this process's) with the recording request and
    the bootstrap directory first on PYTHONPATH (before the user's entries, so that its sitecustomize is found
    first; it runs the one it hides)."""
    env = dict(os.environ if environ is None else environ)
    env[ENV_VAR] = encode(path, options)
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *existing])
    return env


def part_path(path: str, part: int) -> str:
    """The job path of the run's `part`-th part: RUN itself for part 1."""
    if part == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{_PART}{part}{ext}"


def run_files(path: str) -> list[str]:
    """Every file of the run at `path` that exists: RUN, its parts, and their rank files (``.rankR-of-W``)."""
    stem, ext = os.path.splitext(os.path.abspath(path))
    folder, base = os.path.split(stem)
    pattern = re.compile(re.escape(base) + rf"(\.{_PART}[0-9]+)?(\.rank[0-9]+-of-[0-9]+)?" + re.escape(ext))
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, name) for name in names
            if pattern.fullmatch(name) and os.path.isfile(os.path.join(folder, name))]
