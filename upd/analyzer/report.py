"""One file to share an analysis: ``upd analyze RUN --html report.html``.

A folder of PNGs and CSVs does not travel well in a chat or a ticket; one HTML file does. The report holds the
figures (PNG embedded as base64 data URIs), the summary table, the run's metadata and, when asked, the verify
result, with inline CSS and no script, so it opens from disk in any browser without a server. Every text that comes
from the run file (parameter names, option values, the path) is escaped: a run file may come from anyone.
"""
from __future__ import annotations

import base64
import datetime
import html
import json
import math

import pandas as pd

from .. import __version__
from ..outputs import open_output
from ..safe_text import LISTED_NAMES
from .analyze import Analysis
from .summary import FLAGGED_STATUSES, SUMMARY_HEADERS, Thresholds

FIGURE_CAPTIONS = {
    "update_to_data.png": "update:data per weight over the steps (healthy near the guide), with the learning rate "
                          "and the loss on the same step axis",
    "grad_to_data.png": "grad:data per weight over the steps",
    "grad_histograms.png": "gradient values per weight at the compared steps",
    "weight_histograms.png": "weight values per weight at the compared steps",
}

# Verify's per-parameter table as the report and `upd verify` show it: its columns (VerifyReport.by_param's names)
# and their headers. err_to_tol and update_rel_err are two different yardsticks of one error (docs/verify.md).
VERIFY_COLUMNS = ["param", "checked", "mismatched", "err_to_tol", "update_rel_err", "first_mismatch_step", "result"]
VERIFY_HEADERS = {"err_to_tol": "err/tol", "update_rel_err": "err/update", "first_mismatch_step": "first mismatch",
                  "first_mismatch_rank": "rank"}
VERIFY_COLUMNS_TEXT = (
    "err/tol: the worst error over the parameter's checks divided by the check's tolerance (a check passes at "
    "1 or below). err/update: the worst error divided by the largest recorded update of that step, how large the "
    "error is next to the update itself: near 0 on a conclusive match; near 1 or above only where the update is at "
    "the storage's precision (an lr scheduled to almost 0, reduced-precision storage), which the tolerance "
    "allows (such a check is usually inconclusive).")
NOTE_COLUMNS = ("explanation",)  # long text: the cell wraps

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1250px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
.scroll { overflow-x: auto; max-width: 100%; } td.note { text-align: left; min-width: 20em; }
th, td { border: 1px solid #ddd; padding: 2px 8px; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
td.HIGH { color: #c0392b; font-weight: bold; } td.LOW { color: #1f5fa8; font-weight: bold; }
td.FAIL { color: #c0392b; font-weight: bold; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; } pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; }
.verdict { font-size: 1.05em; } .flagged { color: #c0392b; }
"""


def _text(value) -> str:
    """A cell's text, escaped: numbers to 2 decimals (3 significant digits when small), missing as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.3g}"
    return html.escape(str(value))


def html_table(frame: pd.DataFrame, headers: dict | None = None, class_column: str | None = None) -> str:
    """A DataFrame as an escaped HTML table; text columns left-aligned; class_column's value (escaped) also
    becomes the class of its cell, for colouring a status."""
    headers = headers or {}
    text_columns = {c for c in frame.columns if frame[c].dtype == object or str(frame[c].dtype) in ("str", "string")}
    head = "".join(f'<th class="{"text" if c in text_columns else ""}">{html.escape(str(headers.get(c, c)))}</th>'
                   for c in frame.columns)
    rows = []
    for record in frame.itertuples(index=False):
        cells = []
        for column, value in zip(frame.columns, record):
            classes = ["text"] if column in text_columns else []
            if column in NOTE_COLUMNS:
                classes.append("note")
            if column == class_column and str(value) in (*FLAGGED_STATUSES, "FAIL"):
                classes.append(str(value))
            cells.append(f'<td class="{" ".join(classes)}">{_text(value)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    # Its own box: a wide table (many groups, long names) scrolls inside it, never past the page's edge.
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


NO_HISTOGRAMS = ("No histograms: the run holds no full-tensor record of a weight (statistics only), and a histogram "
                 "needs the values themselves. Record full tensors now and then (upd.record(..., every=N)) to get "
                 "them.")


def verify_table(by_param: pd.DataFrame) -> pd.DataFrame:
    """VerifyReport.by_param()'s columns that verify's tables show, in order: the inconclusive count when there is
    one, the rank of the first mismatch for a job, the optimizer when there are several, the explanation when a
    mismatch has one."""
    columns = list(VERIFY_COLUMNS)
    if by_param["inconclusive"].any():
        columns.insert(columns.index("mismatched") + 1, "inconclusive")
    if "first_mismatch_rank" in by_param:  # a distributed job
        columns.insert(columns.index("first_mismatch_step") + 1, "first_mismatch_rank")
    if by_param["optimizer"].nunique() > 1:
        columns.insert(0, "optimizer")
    if (by_param["explanation"] != "").any():
        columns.append("explanation")
    return by_param[columns]


VERDICT_NAMES = LISTED_NAMES  # flagged weights the verdict names; the summary table (and summary.csv) has all


def verdict(analysis: Analysis, thresholds: Thresholds, names: int = VERDICT_NAMES) -> str:
    """The one line `upd analyze` ends with: which weights are flagged (the first `names` of them named), or that
    none is (never about zero)."""
    bounds = f"[{thresholds.low:g}, {thresholds.high:g}]"
    flagged = analysis.flagged
    if len(flagged):
        more = f", and {len(flagged) - names} more (the table lists them)" if len(flagged) > names else ""
        return (f"{len(flagged)} weight(s) outside {bounds} (healthy near {thresholds.target:g}): "
                + ", ".join(f"{r.param} {r.status} ({r.median_update_to_data:.2f})"
                            for r in flagged.head(names).itertuples()) + more)
    if not analysis.summary["status"].isin(["ok", *FLAGGED_STATUSES]).any():
        return "no weight (ndim >= 2) with a finite update:data ratio was recorded: nothing to judge"
    return f"all weights within {bounds}"


def _figures(images: dict) -> str:
    parts = []
    for name, png in images.items():
        data = base64.b64encode(png).decode("ascii")
        caption = FIGURE_CAPTIONS.get(name, name)
        parts.append(f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{html.escape(caption)} ({html.escape(name)})</figcaption></figure>")
    return "\n".join(parts)


def _metadata(description: dict, groups: dict | None = None) -> str:
    created = description.get("created_unix")
    try:
        created = datetime.datetime.fromtimestamp(float(created), datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        created = "-"
    facts = {"file": description.get("path"), "size": f"{(description.get('size_bytes') or 0) / 1e6:.1f} MB",
             "created": created, "torch": description.get("torch_version"),
             "recorded with torch-upd": description.get("upd_version"),
             "format version": description.get("format_version")}
    if description.get("live"):
        facts["being written"] = "yes: the records committed when the report was made"
    rows = "".join(f'<tr><th class="text">{html.escape(k)}</th><td class="text">{_text(v)}</td></tr>'
                   for k, v in facts.items())
    groups = groups or {}
    optimizers = pd.DataFrame([{
        "optimizer": o.get("index"), "class": o.get("class"), "param groups": o.get("param_groups"),
        "full records": o.get("records"),
        "steps": "-" if o.get("first_step") is None else f"{o.get('first_step')}..{o.get('last_step')}",
        "statistics steps": o.get("stats_steps"), "parameters": len(o.get("params", []))}
        | ({} if o.get("index") in groups else {  # no group's own values recorded: the constructor's, so labelled
            "constructor defaults": json.dumps(o.get("defaults", {}), sort_keys=True, default=str)})
        for o in description.get("optimizers", [])])
    group_parts = "".join(
        f"<p>Optimizer {index}: each param group's hyperparameters (a value the run changed: at the first "
        f"and the last full record)</p>" + html_table(group_table(*first_last))
        for index, first_last in groups.items())
    options = json.dumps(description.get("options", {}), indent=1, sort_keys=True, default=str)
    return (f"<table>{rows}</table>" + (html_table(optimizers) if len(optimizers) else "") + group_parts
            + f"<p>Recording options:</p><pre>{html.escape(options)}</pre>")


def _findings(analysis: Analysis) -> str:
    """The findings section: an ordered list of the findings, or the one healthy line."""
    if not analysis.findings:
        return f"<h2>Findings</h2><p>{html.escape(analysis.findings_text().removeprefix('findings: '))}</p>"
    items = "".join(f"<li>{html.escape(f.text)}</li>" for f in analysis.findings)
    return f'<h2>Findings</h2><ol class="flagged">{items}</ol>'


FIRST_HYPERPARAMETERS = ("lr", "weight_decay", "betas", "momentum", "eps")  # the rows a reader looks for, on top


def _value(value) -> str:
    """A hyperparameter as the table shows it: floats to 7 significant digits (a scheduled 0.1 * 0.1 reads 0.01, not
    0.010000000000000002), in lists too (betas)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return format(value, ".7g")
    if isinstance(value, (list, tuple)) and any(isinstance(v, float) for v in value):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value, default=str)


def group_table(first: list[dict], last: list[dict]) -> pd.DataFrame:
    """One row per hyperparameter, one column per param group: its value at the first record, or "first -> last"
    when the run changed it (a schedule's lr). Keys no group sets (None everywhere) are left out."""
    keys = sorted({k for g in first + last for k in g}, key=lambda k: (
        FIRST_HYPERPARAMETERS.index(k) if k in FIRST_HYPERPARAMETERS else len(FIRST_HYPERPARAMETERS), str(k)))
    rows = []
    for key in keys:
        if key == "params" or all(g.get(key) is None for g in first + last):
            continue
        row = {"hyperparameter": str(key)}
        for g, (a, b) in enumerate(zip(first, last + [{}] * (len(first) - len(last)))):
            start, end = _value(a.get(key)), _value(b.get(key, a.get(key)))
            row[f"group {g}"] = start if start == end else f"{start} \u2192 {end}"
        rows.append(row)
    return pd.DataFrame(rows)


def param_groups_of(run) -> dict[int, tuple[list[dict], list[dict]]]:
    """{optimizer index: (its param groups' hyperparameters at the first full record, at the last)}, for the
    optimizers with a full record (a Run's or a Job's; what the report's group tables show)."""
    return {opt.index: (opt.hparams(0), opt.hparams(opt.num_records - 1))
            for opt in run.optimizers if opt.num_records}


def report_html(analysis: Analysis, description: dict, *, thresholds: Thresholds = Thresholds(),
                notes: list[str] = (), verify_report=None, groups: dict | None = None) -> str:
    """The report as one HTML document (a string). description: Run.describe(); notes: extra lines for the
    top (where the numbers come from, clipping); verify_report: a VerifyReport to include; groups:
    param_groups_of(run), each param group's own hyperparameters."""
    title = f"torch-upd report: {description.get('path', '')}"
    summary = analysis.summary.drop(columns=["optimizer"]) \
        if len(analysis.summary) and analysis.summary["optimizer"].nunique() == 1 else analysis.summary
    lines = [*analysis.notes, *notes]
    flagged = len(analysis.flagged) > 0
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="verdict{" flagged" if flagged else ""}">{html.escape(verdict(analysis, thresholds))}</p>',
        "".join(f"<p>{html.escape(line)}</p>" for line in lines),
    ]
    parts[4:4] = [_findings(analysis)]  # findings first, above the verdict
    if analysis.images:  # first: a big model's table is long, and the heatmap is what a reader looks at first
        parts += ["<h2>Figures</h2>", _figures(analysis.images)]
        if not analysis.hist_steps:
            parts.append(f"<p>{html.escape(NO_HISTOGRAMS)}</p>")
    parts += [
        "<h2>Summary</h2>",
        "<p>update:data = log10(std(update) / std(weight)) per step; healthy near "
        f"{thresholds.target:g}. A weight (ndim &gt;= 2) is flagged when its median is above {thresholds.high:g} "
        f"(HIGH) or below {thresholds.low:g} (LOW). \"last step\" is the latest recorded step's value.</p>",
        html_table(summary, SUMMARY_HEADERS, class_column="status") if len(summary)
        else "<p>(no recorded parameters)</p>",
    ]
    if verify_report is not None:
        by_param = verify_report.by_param()
        parts += ["<h2>Verify: the optimizer's math replayed</h2>",
                  f"<pre>{html.escape(verify_report.summary())}</pre>"]
        if len(by_param):
            parts += [html_table(verify_table(by_param), VERIFY_HEADERS, class_column="result"),
                      f"<p>{html.escape(VERIFY_COLUMNS_TEXT)}</p>"]
    parts += ["<h2>Run</h2>", _metadata(description, groups),
              f'<p style="color:#888">made by torch-upd {html.escape(__version__)}</p>', "</body></html>"]
    return "\n".join(parts)


def write_report(path, analysis: Analysis, description: dict, **kwargs) -> str:
    """Write report_html(...) to `path` (UTF-8); returns the path."""
    with open_output(path, text=True) as f:  # never through a link planted under that name
        f.write(report_html(analysis, description, **kwargs))
    return str(path)
