"""`upd analyze` as a Python function: ratios, the per-parameter summary and the figures in one object."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import pandas as pd

from ..outputs import input_files, make_output_dir, open_output, refuse_inputs, write_csv
from ..runfile.job import Job
from ..runfile.reader import Run
from ..runfile.opening import open_run
from ..alert_rules import AlertRules
from ..replay.engine import replica_checks
from ..runfile.job import REPLICATED
from .findings import Finding, find, format_findings, recorded_findings, replica_findings
from .metrics import METRICS, metrics_table, spectral_notes, spectral_rows, with_metric_medians
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
    findings: list = field(default_factory=list)  # [Finding], most severe first (analyzer/findings.py)
    metrics: pd.DataFrame | None = None  # per (optimizer, param, step): std, RMS and spectral ratios (metrics.py)
    rules: AlertRules = AlertRules()  # the thresholds the findings used

    def findings_text(self, escape=str) -> str:
        """The findings section: a numbered line per finding (each passed through escape), or the healthy line."""
        return format_findings(self.findings, self.summary, self.ratios, self.rules, escape)

    def to_dict(self) -> dict:
        """The whole analysis as plain JSON data: findings, summary, per-step metrics, notes (`upd analyze --json`)."""
        def records(frame):
            return [] if frame is None else json.loads(frame.to_json(orient="records"))
        return {"findings": [f.to_dict() for f in self.findings], "findings_text": self.findings_text(),
                "summary": records(self.summary), "metrics": records(self.metrics), "notes": list(self.notes),
                "hist_steps": list(self.hist_steps), "plots": list(self.plots)}

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


# Replica agreement is checked by analyze when the replicas to compare hold at most this many bytes (parameters
# before and after each step, every replica): beyond, reading them all again is verify's job, and analyze says so.
REPLICA_CHECK_BYTES = 256 * 1024 * 1024


def replica_check(run) -> tuple[list[Finding], list[str]]:
    """(findings, notes) on the replicas of a distributed job recorded with ranks="all": diverging replicas as
    findings when they are cheap to compare, else a note saying they were not compared; nothing for a single file
    or a job without replicas."""
    if not isinstance(run, Job):
        return [], []
    size = 0
    for opt in run.optimizers:
        for p in opt.param_records.values():
            if getattr(p, "layout", None) == REPLICATED and len(getattr(p, "ranks", ())) > 1:
                size += 2 * p.numel * 8 * p.num_rows * len(p.ranks)
    if not size:
        return [], []
    if size > REPLICA_CHECK_BYTES:
        return [], [f"replicas not compared here ({size / 1e6:.0f} MB to read): `upd verify` checks that they agree"]
    return replica_findings(replica_checks(run.ranks)), []


def _stats_if_any(run) -> pd.DataFrame | None:
    """The statistics table when the run recorded one (its zero fractions and state statistics feed the findings)."""
    if not any(opt.committed_stats_steps().size for opt in run.optimizers):
        return None
    return run.stats()


def analyze(run, out_dir=None, *, thresholds: Thresholds = Thresholds(), hist_step: int | None = None,
            all_params: bool = False, plots: bool | None = None, metric: str = "std", progress=None) -> Analysis:
    """Compute ratios and the summary of a run (path, or an open Run or Job).

    plots: draw the figures (default: when out_dir is given); their PNG bytes are in ``.images``. out_dir: write
    summary.csv there, and the PNGs when drawn (the folder is created if needed, never emptied). hist_step: the
    histograms' step (default: the first, middle and last full records); ValueError, before any work, when the
    run has no full-tensor record at that step. metric: the update:data figure's ratio, "std" (Karpathy's),
    "rms" (||update||_F / ||weight||_F) or "spectral" (||update||_2 / ||weight||_2, full records only).
    progress: called with the name of each stage of the work as it starts (a progress line)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
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
        spectral, too_large = spectral_rows(run)
        metrics = metrics_table(ratios, spectral)
        summary = with_metric_medians(summarize(ratios, params, thresholds), metrics)
        rules = AlertRules(low=thresholds.low, high=thresholds.high)
        findings = find(ratios, params, summary, scalars=run.scalars(), stats=_stats_if_any(run), rules=rules)
        findings += recorded_findings(run.events())
        replicas, replica_notes = replica_check(run)
        findings = sorted(findings + replicas, key=lambda f: -f.severity)
        images = {}
        if plots:
            from .plots import render_all  # matplotlib is imported only when plots are asked for

            images = render_all(run, ratios, summary, thresholds=thresholds, hist_steps=hist_steps,
                                all_params=all_params, sample=estimated_from_samples(ratios, run.options),
                                metric=METRICS[metric], metrics=metrics,
                                drawing=lambda name: stage(f"drawing {name}"))
        written = []
        if out_dir is not None:
            make_output_dir(out_dir)
            # no output replaces an input: every name written here, checked before the first is written
            refuse_inputs([os.path.join(out_dir, name) for name in [*images, SUMMARY_CSV]], input_files([run.path]))
            for name, png in images.items():
                path = os.path.join(out_dir, name)
                with open_output(path) as f:  # never through a link planted under that name
                    f.write(png)
                written.append(path)
            write_csv(summary, os.path.join(out_dir, SUMMARY_CSV))  # spreadsheet-safe cells
        return Analysis(ratios=ratios, summary=summary, plots=written, images=images, hist_steps=hist_steps,
                        notes=source_notes(ratios, full_steps, hist_steps) + sample_notes(ratios, run.options)
                        + replica_notes + spectral_notes(too_large, spectral, ratios),
                        findings=findings, metrics=metrics, rules=rules)
    finally:
        if own:
            run.close()
