"""Resuming a run (training restarted from a checkpoint): where step numbers continue, and what must not change.

Records of one run are compared step by step and parameter by parameter by name, so a resumed run must hold the same
optimizer class and the same parameters with the same shapes; anything else belongs in a new file.

A checkpoint is often older than the last recorded step (nanoGPT saves at its evaluation, then takes more steps
before it stops): the steps after it are trained again. The rule (docs/reliability.md, "Resuming"): the run is
truncated back to the resumed step, dropping every record, statistics row and logged scalar of the steps the
restarted training repeats, so the file holds one history, the one the model went through; the recorder warns once
with what it dropped, and ``run.resumes`` keeps it (``truncated``). ``upd info`` and ``upd verify`` then count the
same records.
"""
from __future__ import annotations

from typing import Callable

import torch


def initial_step(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer already took (a resumed run), from its per-parameter 'step' state when it keeps one."""
    steps = [int(s["step"]) for s in optimizer.state.values() if isinstance(s.get("step"), (int, float, torch.Tensor))
             and (not isinstance(s.get("step"), torch.Tensor) or s["step"].numel() == 1)]
    return max(steps, default=0)


def has_step_counter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's state counts its steps (plain SGD keeps no counter)."""
    return any(isinstance(s.get("step"), torch.Tensor) for s in optimizer.state.values())


def resume_problems(index: int, stored: dict, now: dict) -> list[str]:
    """Why optimizer `index` cannot be appended to the run: its stored metadata against the metadata it has now
    (class, and parameter names and shapes when the run stored them). Empty when it can."""
    problems = []
    if stored.get("class") != now["class"]:
        problems.append(f"optimizer {index} was {stored.get('class')}, now {now['class']}")
    if stored.get("params") is not None:
        before = {p["name"]: p["shape"] for p in stored["params"]}
        after = {p["name"]: p["shape"] for p in now["params"]}
        missing, added = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        if missing:
            problems.append(f"parameters no longer in optimizer {index}: {', '.join(missing)}")
        if added:
            problems.append(f"parameters new in optimizer {index}: {', '.join(added)}")
        reshaped = [f"{n} {before[n]} -> {after[n]}" for n in sorted(set(before) & set(after)) if before[n] != after[n]]
        if reshaped:
            problems.append(f"shapes changed: {'; '.join(reshaped)}")
    return problems


def truncation_text(path: str, index: int, step: int, dropped: dict) -> str | None:
    """The one warning of a resume that truncated the run (RunWriter.truncate_from's counts), None if it did not."""
    if not any(dropped.values()):
        return None
    parts = [f"{dropped[key]} {label}" for key, label in (("records", "full record(s)"),
                                                           ("stats_rows", "statistics row(s)"),
                                                           ("scalar_rows", "logged-scalar row(s)")) if dropped[key]]
    return (f"torch-upd: {path}: optimizer {index} resumes at step {step}, before the last recorded step: the run was "
            f"truncated back to it ({', '.join(parts)} of steps >= {step} dropped; they were trained again from the "
            "checkpoint). run.resumes lists what each resume dropped.")


def continued_step(writer, path: str, index: int, optimizer: torch.optim.Optimizer, now: dict) -> int | None:
    """Where optimizer `index` continues the run `writer` resumes, when its state keeps no step counter (plain SGD:
    after the last recorded step), else None (its own counter says). ValueError, after closing the writer, when the
    optimizer cannot be appended (``resume_problems``); None for an optimizer the earlier run did not have."""
    stored = writer.optimizer_meta(index)
    if stored is None:
        return None  # recorded from now on
    problems = resume_problems(index, stored, now)
    if problems:
        writer.close()
        raise ValueError(f"{path}: cannot resume into this run: " + "; ".join(problems)
                         + ". Record to a new file instead.")
    last = None if has_step_counter(optimizer) else writer.last_step(index)
    return None if last is None else last + 1


def continue_tracks(writer, path: str, tracks: list, metas: list, warn: Callable[[str], None]) -> None:
    """Continue the run `writer` resumes with `tracks` (``OptimizerTrack``s and their metadata, in the run's order):
    each track's next step number (``continued_step``; ValueError when an optimizer cannot be appended), and the run
    truncated back to it, with one warning through `warn`, where the checkpoint is older than the last recorded
    step."""
    for track, meta in zip(tracks, metas):
        step = continued_step(writer, path, track.index, track.optimizer, meta)
        track.steps_done = track.steps_done if step is None else max(track.steps_done, step)
        # A checkpoint older than the run's last step: the steps after it were trained again.
        dropped = writer.truncate_from(track.index, track.steps_done)
        text = truncation_text(path, track.index, track.steps_done, dropped)
        if text:
            warn(text)
