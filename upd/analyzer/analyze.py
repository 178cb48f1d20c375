"""`upd analyze` as a Python function: ratios, the per-parameter summary and the figures in one object."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pandas as pd

from ..outputs import make_output_dir, open_output, write_csv
from ..runfile.job import Job
from ..runfile.reader import Run, open_run
from .steps import compared_steps, describe_steps, full_record_steps, histogram_keys
from .summary import Thresholds, summarize

SUMMARY_CSV = "summary.csv"


@dataclass
class Analysis:
    ratios: pd.DataFrame  # one row per (optimizer, param, step); see Run.ratios
    summary: pd.DataFrame  # one row per parameter, in model order; see summary.summarize
    plots: list = field(default_factory=list)  # PNG paths written
    images: dict = field(default_factory=dict)  # {file name: PNG bytes} of every figure drawn (the HTML report's)
    hist_steps: list = field(default_factory=list)  # the steps the histograms compare
    notes: list = field(default_factory=list)  # what the reader should know about where the numbers come from

    @property
    def flagged(self) -> pd.DataFrame:
        return self.summary[self.summary["status"].isin(["HIGH", "LOW"])]


def source_notes(ratios: pd.DataFrame, full_steps, hist_steps: list[int]) -> list[str]:
    """Where the ratios and the histograms come from, when it is not obvious: a statistics-mode run's ratios
    cover every step, its histograms only the few full records."""
    notes = []
    from_stats = len(ratios) and (ratios["record"] == -1).any()
    if from_stats:
        notes.append(f"ratios from the per-step statistics (steps {describe_steps(sorted(set(ratios['step'])))})")
    if hist_steps and (from_stats or len(full_steps) > len(hist_steps)):
        notes.append(f"histograms at step{'s' if len(hist_steps) > 1 else ''} {', '.join(map(str, hist_steps))}, "
                     f"from the full-tensor records (steps {describe_steps(full_steps)})")
    elif not len(full_steps):
        notes.append("no full-tensor record of a weight: no histograms")
    return notes


def estimated_from_samples(ratios: pd.DataFrame, options: dict) -> int | None:
    """The sample size K when some of these ratios come from statistics the run estimated from samples
    (stats_sample=K; rows of the statistics table have record -1), else None."""
    sample = options.get("stats_sample")
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 1 or not (
            len(ratios) and (ratios["record"] == -1).any()):  # a file's own text: only a sample size is shown
        return None
    return sample


def sample_notes(ratios: pd.DataFrame, options: dict) -> list[str]:
    """That the per-step statistics are estimates, when the run recorded them from samples (stats_sample)."""
    sample = estimated_from_samples(ratios, options)
    if sample is None:
        return []
    return [f"statistics estimated from a sample of {sample} elements of each tensor larger than that "
            f"(stats_sample={sample}; docs/performance.md gives the error), exact for the others and at full-set steps"]


def analyze(run, out_dir=None, *, thresholds: Thresholds = Thresholds(), hist_step: int | None = None,
            all_params: bool = False, plots: bool | None = None, progress=None) -> Analysis:
    """Compute ratios and the summary of a run (path, or an open Run or Job).

    plots: draw the figures (default: when out_dir is given); their PNG bytes are in ``.images``. out_dir: write
    summary.csv there, and the PNGs when drawn (the folder is created if needed, never emptied). hist_step: the
    histograms' step (default: the first, middle and last full records); ValueError, before any work, when the
    run has no full-tensor record at that step. progress: called with the name of each stage of the work as it
    starts (a progress line)."""
    stage = progress or (lambda label: None)
    plots = out_dir is not None if plots is None else plots
    own = not isinstance(run, (Run, Job))
    if own:
        run = open_run(run)
    try:
        params = run.params()
        full_steps = full_record_steps(run, histogram_keys(params, all_params))
        hist_steps = compared_steps(full_steps, hist_step)
        stage("computing the ratios")
        ratios = run.ratios()
        summary = summarize(ratios, params, thresholds)
        images = {}
        if plots:
            from .plots import render_all  # matplotlib is imported only when plots are asked for

            images = render_all(run, ratios, summary, thresholds=thresholds, hist_steps=hist_steps,
                                all_params=all_params, sample=estimated_from_samples(ratios, run.options),
                                drawing=lambda name: stage(f"drawing {name}"))
        written = []
        if out_dir is not None:
            make_output_dir(out_dir)
            for name, png in images.items():
                path = os.path.join(out_dir, name)
                with open_output(path) as f:  # never through a link planted under that name
                    f.write(png)
                written.append(path)
            write_csv(summary, os.path.join(out_dir, SUMMARY_CSV))  # spreadsheet-safe cells
        return Analysis(ratios=ratios, summary=summary, plots=written, images=images, hist_steps=hist_steps,
                        notes=source_notes(ratios, full_steps, hist_steps) + sample_notes(ratios, run.options))
    finally:
        if own:
            run.close()
