"""`upd analyze` as a Python function: ratios, the per-parameter summary and the plots in one object."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pandas as pd

from ..runfile.job import Job
from ..runfile.reader import Run, open_run
from .summary import Thresholds, summarize


@dataclass
class Analysis:
    ratios: pd.DataFrame  # one row per (optimizer, param, record); see Run.ratios
    summary: pd.DataFrame  # one row per parameter; see summary.summarize
    plots: list = field(default_factory=list)  # PNG paths written

    @property
    def flagged(self) -> pd.DataFrame:
        return self.summary[self.summary["status"].isin(["HIGH", "LOW"])]


def analyze(run, out_dir=None, *, thresholds: Thresholds = Thresholds(), hist_step: int | None = None,
            all_params: bool = False) -> Analysis:
    """Compute ratios and the summary of a run (path, or an open Run or Job); with out_dir, also write the PNG plots
    and summary.csv there (the folder is created if needed, never emptied)."""
    own = not isinstance(run, (Run, Job))
    if own:
        run = open_run(run)
    try:
        ratios = run.ratios()
        summary = summarize(ratios, run.params(), thresholds)
        plots = []
        if out_dir is not None:
            from .plots import render_all  # matplotlib is imported only when plots are asked for

            os.makedirs(out_dir, exist_ok=True)
            plots = render_all(run, ratios, out_dir, thresholds=thresholds, hist_step=hist_step,
                               all_params=all_params)
            summary.to_csv(os.path.join(out_dir, "summary.csv"), index=False)
        return Analysis(ratios=ratios, summary=summary, plots=plots)
    finally:
        if own:
            run.close()
