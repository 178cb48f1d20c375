"""Figures of a run, headless (matplotlib Agg). Each builder returns a Figure; ``png_bytes`` renders it, so the same
figure goes to a PNG file (``upd analyze --out``) or into the self-contained HTML report without a second drawing.

Why these shapes: one line per weight reads for a handful of weights and not for thirty (colours repeat, a legend
covers the curves), so beyond ``LINE_PLOT_MAX_WEIGHTS`` the ratios become a heatmap, weights in model order down,
steps across, flagged weights marked. The learning rate and the loss sit under the ratios on the same step axis,
because a schedule's drop is the usual reason a ratio drops. Histograms get a value range per weight from robust
percentiles, since with one shared range one weight's tails flatten every other curve into a spike at 0, and
compare a few recorded steps (first, middle, last) rather than one.
"""
from __future__ import annotations

import io
import textwrap
import warnings

import matplotlib

matplotlib.use("Agg")  # never needs a display; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402
from matplotlib.ticker import LogFormatterSciNotation, MaxNLocator, NullFormatter  # noqa: E402

from ..runfile import schema, tensor_blocks  # noqa: E402
from ..safe_text import plot_label  # noqa: E402
from .metrics import METRIC_TITLES  # noqa: E402
from .summary import FLAGGED_STATUSES, Thresholds, is_weight, model_order_keys  # noqa: E402

LINE_PLOT_MAX_WEIGHTS = 10  # more weights than this: the ratios are drawn as a heatmap
HISTOGRAM_MAX_PANELS = 48  # more weights than this: the flagged ones and an even spread of the others
HISTOGRAM_COLUMNS = 4  # panels per row: the figure is then about 1200 px wide, shown unscaled in the HTML report
HISTOGRAM_FONT = 8.5  # points (12 px at DPI): ticks and panel notes stay readable in the report
HISTOGRAM_PERCENTILES = (1.0, 99.0)  # each panel's value range when far tails would flatten the rest
TAILS_KEPT_UP_TO = 3.0  # the full extent is drawn unless it is this many times wider than the percentile range
STAIRS_BELOW = 1000  # tensors with fewer values are drawn as step histograms
HISTOGRAM_SAMPLE = 1 << 20  # values per tensor the histograms are computed on (a strided sample beyond that)
HEATMAP_MAX_COLUMNS = 600  # more steps than this: adjacent steps are merged (median) into this many columns
HEATMAP_SPAN = 3.0  # update:data colour scale: target +- this (log10), the same in every run so runs compare
MARKERS_UP_TO = 30  # series with at most this many points get markers (a one-step run must show something)
DPI = 100
STATUS_COLOURS = {"HIGH": "#c0392b", "LOW": "#1f5fa8"}
STEP_COLOURS = ("#9ecae1", "#3182bd", "#08306b")  # first, middle, last compared step: light to dark
NAME_WIDTH = 40  # characters of a parameter name shown in a panel title or a heatmap row


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes; closes it."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    return buf.getvalue()


def short_name(name: str, width: int = NAME_WIDTH) -> str:
    """A parameter name cut from the left (the end says which tensor it is), so labels keep a bounded width."""
    name = plot_label(name, limit=len(name) + 1)  # the file's text: no control characters, no mathtext
    return name if len(name) <= width else "…" + name[-(width - 1):]


def key_label(key, multi_optimizer: bool) -> str:
    return plot_label(f"opt{key[0]}:{key[1]}" if multi_optimizer else key[1])  # escaped, bounded: file text


def quantity_label(column: str) -> str:
    """'update_to_data' -> 'update:data'."""
    return column.replace("_to_", ":")


# -- data shaping (pure) ----------------------------------------------------------------------------------------
def plotted_keys(ratios: pd.DataFrame, params: pd.DataFrame, all_params: bool) -> list[tuple[int, str]]:
    """(optimizer, param) of what the ratio figures show, in model order: the weights (ndim >= 2), or every
    parameter with all_params, that have rows in `ratios`."""
    shapes = {(r.optimizer, r.param): r.shape for r in params.itertuples()}
    present = set(map(tuple, ratios[["optimizer", "param"]].drop_duplicates().itertuples(index=False)))
    return [k for k in model_order_keys(params, ratios)
            if k in present and (all_params or is_weight(shapes.get(k, ())))]


def ratio_matrix(ratios: pd.DataFrame, keys: list, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values): values[i, j] is `column` of keys[i] at steps[j], NaN where not recorded or not finite."""
    if not keys:
        return np.zeros(0, np.int64), np.zeros((0, 0))
    index = pd.MultiIndex.from_tuples(keys, names=["optimizer", "param"])
    table = ratios.pivot_table(index=["optimizer", "param"], columns="step", values=column, aggfunc="last",
                               dropna=False)
    table = table.reindex(index)
    values = table.to_numpy(dtype=float, copy=True)
    values[~np.isfinite(values)] = np.nan
    return table.columns.to_numpy(dtype=np.int64), values


def merge_columns(steps: np.ndarray, values: np.ndarray, max_columns: int) -> tuple[np.ndarray, np.ndarray]:
    """At most max_columns columns: runs of adjacent steps merged into one column holding their median (NaN where
    a row has no finite value in the run), placed at the run's first step."""
    if len(steps) <= max_columns:
        return steps, values
    groups = np.array_split(np.arange(len(steps)), max_columns)
    merged = np.full((values.shape[0], len(groups)), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "All-NaN slice": such a cell stays NaN, as documented
        for j, cols in enumerate(groups):
            merged[:, j] = np.nanmedian(values[:, cols], axis=1)
    return steps[[g[0] for g in groups]], merged


def step_edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around each recorded step (half way to its neighbours), for a heatmap on the step axis."""
    steps = np.asarray(steps, dtype=float)
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mids = (steps[:-1] + steps[1:]) / 2
    return np.concatenate([[steps[0] - (mids[0] - steps[0])], mids, [steps[-1] + (steps[-1] - mids[-1])]])


def lr_series(ratios: pd.DataFrame, params: pd.DataFrame) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{label: (steps, lr)} per (optimizer, param group), from the ratios table: it has the lr of every step the
    ratios cover (statistics mode: every step), where the records alone may be sparse. Groups whose schedules are
    the same at every step are one series ("group 0 = group 1"): drawn apart, the last hid the others."""
    groups = {(r.optimizer, r.param): (0 if r.group is None or r.group != r.group else int(r.group))
              for r in params.itertuples()}
    if ratios.empty:
        return {}
    table = ratios[["optimizer", "param", "step", "lr"]].copy()
    table["group"] = [groups.get(k, 0) for k in zip(table["optimizer"], table["param"])]
    table = table.drop_duplicates(["optimizer", "group", "step"]).sort_values(["optimizer", "group", "step"])
    multi_opt = table["optimizer"].nunique() > 1
    series = {}
    for (opt, group), df in table.groupby(["optimizer", "group"], sort=True):
        label = (f"opt{opt} " if multi_opt else "") + f"group {group}"
        series[label] = (df["step"].to_numpy(), df["lr"].to_numpy(dtype=float))
    return same_series_merged(series)


SAME_SERIES = " = "  # joins the labels of series drawn as one (same_series_merged)


def same_series_merged(series: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The series, those with the same steps and values (NaN equal to NaN) joined under one label "a = b", in the
    order of their first."""
    merged: list[tuple[list[str], tuple[np.ndarray, np.ndarray]]] = []
    for label, (steps, values) in series.items():
        for labels, (s, v) in merged:
            if np.array_equal(s, steps) and np.array_equal(v, values, equal_nan=True):
                labels.append(label)
                break
        else:
            merged.append(([label], (steps, values)))
    return {SAME_SERIES.join(labels): data for labels, data in merged}


def scalar_series(scalars: pd.DataFrame | None, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{label: (steps, values)} of one logged scalar per optimizer that logged it (empty when none did)."""
    if scalars is None or name not in getattr(scalars, "columns", ()):
        return {}
    multi_opt = scalars["optimizer"].nunique() > 1
    series = {}
    for opt, df in scalars.groupby("optimizer", sort=True):
        df = df[np.isfinite(df[name].to_numpy(dtype=float))].sort_values("step")
        if len(df):
            series[f"opt{opt}" if multi_opt else name] = (df["step"].to_numpy(), df[name].to_numpy(dtype=float))
    return series


# -- drawing helpers --------------------------------------------------------------------------------------------
def _plot_series(ax, steps, values, **kwargs):
    if len(steps) <= MARKERS_UP_TO:
        kwargs.setdefault("marker", "o")
        kwargs.setdefault("markersize", 5 if len(steps) == 1 else 3)
    return ax.plot(steps, values, **kwargs)


def _log_scale_if_spread(ax, values: list) -> None:
    """A log y scale when the positive values span a factor 5 or more (a decaying lr). Under two decades a power
    of ten or two is all the major ticks show (a warm-up to 6e-4 decayed to 6e-5 read "1e-4" alone), so some minor
    ticks are labelled too; beyond, major labels only."""
    finite = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.zeros(0)
    if len(finite) and finite.min() > 0 and finite.max() / finite.min() >= 5:
        ax.set_yscale("log")
        if finite.max() / finite.min() < 100:
            ax.yaxis.set_minor_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
            ax.tick_params(axis="y", which="minor", labelsize=7)
        else:
            ax.yaxis.set_minor_formatter(NullFormatter())


def _draw_side_series(ax, series: dict, ylabel: str, log_when_spread: bool, held: bool = False) -> None:
    """The lr or loss axes under the ratios: one line per series, a log scale when the values span a decade.
    held: each value holds until the next step (a schedule), drawn as steps."""
    for label, (steps, values) in series.items():
        _plot_series(ax, steps, values, label=label, linewidth=1, drawstyle="steps-post" if held else "default")
    ax.set_ylabel(ylabel)
    if log_when_spread:
        _log_scale_if_spread(ax, [v for _, v in series.values()])
    if len(series) > 1 or any(SAME_SERIES in label for label in series):  # one line for several groups: say so
        ax.legend(fontsize=7, loc="upper right", ncol=min(4, len(series)))
    ax.grid(alpha=0.3)


def _integer_steps(ax, steps) -> None:
    """Step ticks are integers: the steps themselves when there are a few, else integer-only locations."""
    unique = np.unique(np.asarray(steps, dtype=np.int64))
    if 0 < len(unique) <= 8:
        ax.set_xticks(unique)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _status_of(flagged: dict, key) -> str:
    status = flagged.get(key, "")
    return status if status in FLAGGED_STATUSES else ""


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


# -- the ratio figure -------------------------------------------------------------------------------------------
def ratio_figure(ratios: pd.DataFrame, params: pd.DataFrame, column: str, *, title: str,
                 scalars: pd.DataFrame | None = None, thresholds: Thresholds | None = None,
                 guide: float | None = None, flagged: dict | None = None, all_params: bool = False):
    """`column` of every weight over the optimizer steps: a line per weight for up to LINE_PLOT_MAX_WEIGHTS, a
    heatmap (model order down, steps across) beyond; under it, on the same step axis, the learning rate of each
    param group and the logged loss when the run has one. flagged: {(optimizer, param): status}."""
    flagged = flagged or {}
    keys = plotted_keys(ratios, params, all_params)
    multi_opt = ratios["optimizer"].nunique() > 1 if len(ratios) else False
    steps, values = ratio_matrix(ratios, keys, column)
    heatmap = len(keys) > LINE_PLOT_MAX_WEIGHTS
    lrs = lr_series(ratios, params)
    losses = scalar_series(scalars, schema.SCALAR_LOSS)
    side = [("learning rate", lrs, True)] + ([("loss", losses, True)] if losses else [])

    main_height = min(14.0, max(3.2, 0.17 * len(keys))) if heatmap else 4.0
    heights = [main_height] + [1.3] * len(side)
    fig = plt.figure(figsize=(12, sum(heights) + 0.8), layout="constrained")
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=[1, 0.025 if heatmap else 0.3])
    ax = fig.add_subplot(grid[0, 0])
    axes = [ax] + [fig.add_subplot(grid[i + 1, 0], sharex=ax) for i in range(len(side))]
    side_ax = fig.add_subplot(grid[0, 1])

    if not keys or not np.isfinite(values).any():
        _no_data(ax, "no weights with finite ratios recorded")
        side_ax.axis("off")
    elif heatmap:
        _draw_heatmap(fig, ax, side_ax, keys, steps, values, column, thresholds, guide, flagged, multi_opt,
                      main_height)
    else:
        _draw_lines(ax, side_ax, keys, steps, values, column, thresholds, guide, flagged, multi_opt)
    ax.set_title(title, loc="left", fontsize=11)

    for side_axes, (label, series, log_scale) in zip(axes[1:], side):
        if series:
            _draw_side_series(side_axes, series, label, log_scale, held=label == "learning rate")
        else:
            _no_data(side_axes, f"no {label} recorded")
    for a in axes[:-1]:
        a.tick_params(labelbottom=False)
    axes[-1].set_xlabel("optimizer step")
    all_steps = np.concatenate([steps] + [s for _, series, _ in side for s, _ in series.values()])
    _integer_steps(axes[-1], all_steps)
    if len(all_steps) and not heatmap:
        lo, hi = float(all_steps.min()), float(all_steps.max())
        pad = max(0.5, (hi - lo) * 0.02)
        ax.set_xlim(lo - pad, hi + pad)
    return fig


def _draw_lines(ax, legend_ax, keys, steps, values, column, thresholds, guide, flagged, multi_opt) -> None:
    handles = []
    for key, row in zip(keys, values):
        status = _status_of(flagged, key)
        label = key_label(key, multi_opt) + (f"  [{status}]" if status else "")
        keep = np.isfinite(row)
        (line,) = _plot_series(ax, steps[keep], row[keep], label=label, linewidth=2.2 if status else 1.1)
        handles.append(line)
    if guide is not None:
        handles.append(ax.axhline(guide, color="k", linestyle="--", linewidth=1, label=f"{guide:g} (guide)"))
    if thresholds is not None:
        ax.axhline(thresholds.high, color=STATUS_COLOURS["HIGH"], linestyle=":", linewidth=0.9)
        handles.append(ax.axhline(thresholds.low, color=STATUS_COLOURS["LOW"], linestyle=":", linewidth=0.9,
                                  label=f"flag bounds {thresholds.low:g}, {thresholds.high:g}"))
    ax.set_ylabel(f"{quantity_label(column)} (log10)")
    ax.grid(alpha=0.3)
    legend_ax.axis("off")
    legend_ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, borderaxespad=0)


def _draw_heatmap(fig, ax, cbar_ax, keys, steps, values, column, thresholds, guide, flagged, multi_opt,
                  main_height: float) -> None:
    shown_steps, shown = merge_columns(steps, values, HEATMAP_MAX_COLUMNS)
    edges = step_edges(shown_steps)
    if guide is not None:  # update:data: diverging around the guide, a fixed span so two runs' colours compare
        cmap, norm = plt.get_cmap("RdBu_r"), Normalize(guide - HEATMAP_SPAN, guide + HEATMAP_SPAN)
    else:
        finite = shown[np.isfinite(shown)]
        lo, hi = np.percentile(finite, [2, 98]) if len(finite) else (0.0, 1.0)
        cmap, norm = plt.get_cmap("viridis"), Normalize(lo, hi if hi > lo else lo + 1)
    cmap = cmap.with_extremes(bad="0.82")  # no finite ratio: a zero update, a one-element tensor, no record
    mesh = ax.pcolormesh(edges, np.arange(len(keys) + 1), np.ma.masked_invalid(shown), cmap=cmap, norm=norm,
                         shading="flat")
    ax.set_ylim(len(keys), 0)  # model order from the top
    labels, colours = [], []
    for key in keys:
        status = _status_of(flagged, key)
        labels.append(short_name(key_label(key, multi_opt)) + (f"  ◀ {status}" if status else ""))
        colours.append(STATUS_COLOURS.get(status, "black"))
    ax.set_yticks(np.arange(len(keys)) + 0.5)
    row_points = main_height * 72 / max(1, len(keys))
    ax.set_yticklabels(labels, fontsize=float(np.clip(row_points * 0.6, 4, 8)))
    for tick, colour in zip(ax.get_yticklabels(), colours):
        tick.set_color(colour)
        if colour != "black":
            tick.set_fontweight("bold")
    ax.set_ylabel("weights, in model order")
    cbar = fig.colorbar(mesh, cax=cbar_ax, extend="both")
    cbar.set_label(f"{quantity_label(column)} (log10); grey: no finite value", fontsize=8)
    if guide is not None:
        cbar.ax.axhline(guide, color="k", linewidth=1)
        ticks = {guide - HEATMAP_SPAN: f"{guide - HEATMAP_SPAN:g}", guide: f"{guide:g}",
                 guide + HEATMAP_SPAN: f"{guide + HEATMAP_SPAN:g}"}
        if thresholds is not None:
            for bound, status in ((thresholds.high, "HIGH"), (thresholds.low, "LOW")):
                cbar.ax.axhline(bound, color=STATUS_COLOURS[status], linewidth=2, linestyle=(0, (2, 1)))
                ticks[bound] = f"{bound:g} {status}"
        cbar.set_ticks(sorted(ticks), labels=[ticks[t] for t in sorted(ticks)], fontsize=7)
    counts = pd.Series([_status_of(flagged, k) for k in keys]).value_counts()
    marked = ", ".join(f"{counts[s]} {s}" for s in FLAGGED_STATUSES if s in counts)
    if marked:
        ax.set_title(f"flagged on the median update:data: {marked}", loc="right", fontsize=8,
                     color=STATUS_COLOURS["HIGH"])
    elif thresholds is not None:
        ax.set_title("no weight flagged", loc="right", fontsize=8, color="0.4")
    if len(shown_steps) < len(steps):
        ax.set_title(f"{len(steps)} steps merged into {len(shown_steps)} columns (median)", loc="center",
                     fontsize=8, color="0.4")


# -- histograms -------------------------------------------------------------------------------------------------
def pick_panels(keys: list, priority: set, limit: int) -> list:
    """At most `limit` of keys, in their order: all in `priority` first (up to the limit), the rest spread evenly."""
    if len(keys) <= limit:
        return list(keys)
    first = [k for k in keys if k in priority][:limit]
    others = [k for k in keys if k not in priority]
    room = limit - len(first)
    spread = [others[int(i)] for i in np.linspace(0, len(others) - 1, room)] if room > 0 and others else []
    chosen = set(first) | set(spread)
    return [k for k in keys if k in chosen]


def _sample(t: torch.Tensor) -> np.ndarray:
    values = t.detach().reshape(-1)
    if values.numel() > HISTOGRAM_SAMPLE:
        values = values[:: -(-values.numel() // HISTOGRAM_SAMPLE)]
    values = values.double().numpy()
    return values[np.isfinite(values)]


def row_sample(p, kind: str, row: int, block_elements: int | None = None) -> np.ndarray:
    """_sample of one recorded row of a parameter: the same values, read a block of elements (default: verify's
    block) at a time when the row is larger than a block, the strided sample taken from each block where the whole
    row's stride falls: a whole row of a 200 MB weight is never held."""

    block_elements = block_elements or tensor_blocks.BLOCK_ELEMENTS
    if not hasattr(p, "read_part") or p.numel <= block_elements:  # a distributed job's stitched parameter: whole
        return _sample(p.read(kind, row))

    stride = max(1, -(-p.numel // HISTOGRAM_SAMPLE))
    parts, start = [], 0
    for index in tensor_blocks.element_blocks(p.stored_shape(kind), block_elements):  # contiguous runs, in order
        piece = p.read_part(kind, slice(row, row + 1), index).reshape(-1)
        parts.append(piece[(-start) % stride::stride].double())
        start += piece.numel()
    values = torch.cat(parts).numpy()
    return values[np.isfinite(values)]


def histogram_panels(run, keys: list, kind: str, steps: list[int]) -> list[tuple[tuple, dict[int, np.ndarray]]]:
    """[(key, {step: finite values})] for each of keys (in order) that has a `kind` record at one of `steps`."""
    wanted = set(keys)
    found = {}
    for p in run.iter_params():
        key = (p.optimizer.index, p.name)
        if key not in wanted or not p.num_rows or kind not in p.kinds:
            continue
        row_steps = p.optimizer.steps[p.records]
        per_step = {}
        for step in steps:
            rows = np.nonzero(row_steps == step)[0]
            if len(rows):
                per_step[step] = row_sample(p, kind, int(rows[0]))
        if per_step:
            found[key] = per_step
    return [(k, found[k]) for k in keys if k in found]


def robust_range(values: list[np.ndarray]) -> tuple[float, float] | None:
    """The HISTOGRAM_PERCENTILES range of all values together; None without a finite value, a small interval
    around a constant."""
    pooled = np.concatenate(values) if values else np.zeros(0)
    if not len(pooled):
        return None
    lo, hi = np.percentile(pooled, HISTOGRAM_PERCENTILES)
    low, high = float(pooled.min()), float(pooled.max())
    if high - low <= TAILS_KEPT_UP_TO * (hi - lo):  # no far tails: show every value
        lo, hi = low, high
    if hi <= lo:
        lo, hi = float(pooled.min()), float(pooled.max())
    if hi <= lo:
        half = max(abs(lo) * 0.05, 1e-12)
        return lo - half, hi + half
    return float(lo), float(hi)


def histogram_figure(panels: list, *, title: str, value_label: str, flagged: dict | None = None,
                     multi_optimizer: bool = False, note: str = "", bins: int = 50):
    """One panel per weight: the distribution of its values at each compared step (light: first, dark: last),
    over the weight's own range (robust_range); the share of values beyond it is written in the panel.
    panels: histogram_panels()."""
    flagged = flagged or {}
    n = max(1, len(panels))
    ncols = min(n, HISTOGRAM_COLUMNS)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.9 * ncols + 0.4, 2.3 * nrows + 1.2), squeeze=False,
                             layout="constrained")
    all_steps = sorted({s for _, per_step in panels for s in per_step})
    palette = {1: STEP_COLOURS[-1:], 2: STEP_COLOURS[::2]}.get(len(all_steps), STEP_COLOURS)  # first light, last dark
    colours = dict(zip(all_steps, palette))
    for ax, (key, per_step) in zip(axes.flat, panels):
        status = _status_of(flagged, key)
        ax.set_title(short_name(key_label(key, multi_optimizer), 34) + (f" [{status}]" if status else ""),
                     fontsize=HISTOGRAM_FONT + 1, color=STATUS_COLOURS.get(status, "black"),
                     fontweight="bold" if status else "normal")
        span = robust_range(list(per_step.values()))
        if span is None:
            _no_data(ax, "no finite values")
            continue
        fewest = min(len(v) for v in per_step.values() if len(v)) if any(len(v) for v in per_step.values()) else 1
        edges = np.linspace(span[0], span[1], int(np.clip(np.sqrt(fewest), 8, bins)) + 1)
        outside = 0
        total = 0
        for step, values in per_step.items():
            counts, _ = np.histogram(values, bins=edges)
            # Density over all values, so the area drawn is the share inside the range.
            density = counts / max(1, len(values)) / np.diff(edges)
            if fewest < STAIRS_BELOW:  # few values: bars as counted, not a line suggesting a smooth density
                ax.stairs(density, edges, color=colours.get(step, "k"), linewidth=1.2)
            else:
                ax.plot((edges[:-1] + edges[1:]) / 2, density, color=colours.get(step, "k"), linewidth=1.2)
            outside += len(values) - counts.sum()
            total += len(values)
        last = per_step[max(per_step)]
        text = f"std {last.std():.2g}" if len(last) > 1 else ""
        if total and outside:
            text += f"\n{100 * outside / total:.1f}% outside"
        ax.text(0.98, 0.95, text, transform=ax.transAxes, ha="right", va="top", fontsize=HISTOGRAM_FONT, color="0.3",
                bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1})
        ax.tick_params(labelsize=HISTOGRAM_FONT)
        ax.xaxis.set_major_locator(MaxNLocator(4))  # narrow panels: more tick labels would overlap
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
        ax.xaxis.get_offset_text().set_fontsize(HISTOGRAM_FONT)
        ax.set_yticks([])
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    if not panels:
        _no_data(axes.flat[0], "no full-tensor records to draw")
    for col in range(ncols):  # under the lowest drawn panel of each column
        lowest = max(i for i in range(col, max(len(panels), 1), ncols))
        axes.flat[lowest].set_xlabel(value_label, fontsize=HISTOGRAM_FONT + 1)
    for ax in axes[:, 0]:
        ax.set_ylabel("density", fontsize=HISTOGRAM_FONT + 1)
    handles = [plt.Line2D([], [], color=colours[s], linewidth=2) for s in all_steps]
    if handles:
        fig.legend(handles, [f"step {s}" for s in all_steps], loc="outside lower center", ncol=len(handles),
                   fontsize=HISTOGRAM_FONT + 1, frameon=False)
    width_chars = int(fig.get_figwidth() * 9)
    fig.suptitle("\n".join(textwrap.wrap(title + (f"; {note}" if note else ""), width_chars)), fontsize=11,
                 x=0.01, ha="left")
    return fig


# -- the standard set ---------------------------------------------------------------------------------------------
RATIO_FIGURES = (  # file name, column, title
    ("update_to_data.png", "update_to_data", "update:data ratio, log10(std(update) / std(weight))"),
    ("grad_to_data.png", "grad_to_data", "grad:data ratio, log10(std(grad) / std(weight))"),
)
HISTOGRAM_FIGURES = (  # file name, kind, what the values are
    ("grad_histograms.png", schema.KIND_GRAD, "gradient"),
    ("weight_histograms.png", schema.KIND_PARAM, "weight"),
)


def render_all(run, ratios: pd.DataFrame, summary: pd.DataFrame, *, thresholds: Thresholds,
               hist_steps: list[int], all_params: bool = False, sample: int | None = None,
               metric: str = "update_to_data", metrics: pd.DataFrame | None = None,
               drawing=None) -> dict[str, bytes]:
    """The standard figures as {file name: PNG bytes}: update:data and grad:data over the steps (with lr and loss),
    and gradient and weight histograms at hist_steps (see compared_steps). sample: the K of a run whose statistics
    were estimated from K elements per tensor (stats_sample), said in the ratio figures' titles. metric: the ratio
    update_to_data.png draws, a column of `metrics` (analyzer/metrics.py: the RMS or spectral ratio instead of
    the std ratio). drawing(name): called as each figure starts (a progress line)."""
    drawing = drawing or (lambda name: None)
    params = run.params()
    scalars = run.scalars() if hasattr(run, "scalars") else None
    flagged = {(r.optimizer, r.param): r.status for r in summary.itertuples()}
    images = {}
    for name, column, title in RATIO_FIGURES:
        update = column == "update_to_data"
        source = ratios
        if update and metric != column and metrics is not None:
            chosen = metrics.loc[metrics[metric].notna(), ["optimizer", "param", "step", metric]]
            source = ratios.drop(columns=[column]).merge(chosen, on=["optimizer", "param", "step"]).rename(
                columns={metric: column})
            title = METRIC_TITLES[metric]
        if sample is not None:
            title += f"; per-step statistics estimated from {sample} elements of each larger tensor"
        drawing(name)
        images[name] = png_bytes(ratio_figure(
            source, params, column, title=title, scalars=scalars, thresholds=thresholds if update else None,
            guide=thresholds.target if update else None, flagged=flagged, all_params=all_params))
    keys = plotted_keys(ratios, params, all_params) if len(ratios) else []
    if not keys:  # no ratio rows (nothing stepped twice?): histograms of what was recorded all the same
        keys = [(r.optimizer, r.param) for r in params.itertuples() if all_params or is_weight(r.shape)]
    multi_opt = len({k[0] for k in keys}) > 1
    chosen = pick_panels(keys, {k for k in keys if _status_of(flagged, k)}, HISTOGRAM_MAX_PANELS)
    note = f"{len(chosen)} of {len(keys)} weights: every flagged one, the rest spread in model order" \
        if len(chosen) < len(keys) else ""
    for name, kind, what in HISTOGRAM_FIGURES if hist_steps else ():  # no full record: no figure (the notes say)
        drawing(name)
        panels = histogram_panels(run, chosen, kind, hist_steps)
        title = f"{what} values per weight at step{'s' if len(hist_steps) > 1 else ''} " \
                f"{', '.join(map(str, hist_steps))} (each panel its own range; far tails cut, counted as outside)"
        images[name] = png_bytes(histogram_figure(panels, title=title, value_label=f"{what} value", flagged=flagged,
                                                  multi_optimizer=multi_opt, note=note))
    return images


# -- comparing runs -----------------------------------------------------------------------------------------------
COMPARE_MAX_PANELS = 36  # weight panels; beyond: the flagged ones, those the runs disagree on most, an even spread
RUN_COLOURS = plt.get_cmap("tab10").colors


# A run's param groups in the compare figure's lr panel: (matplotlib style, the name its title gives it).
GROUP_LINE_STYLES = (("-", "solid"), ("--", "dashed"), (":", "dotted"), ("-.", "dash-dot"))


def compare_figure(ratios: dict, params: dict, keys: list, column: str, *, scalars: dict | None = None,
                   thresholds: Thresholds | None = None, guide: float | None = None, priority: set = frozenset(),
                   spread: dict | None = None):
    """One panel per weight overlaying the runs' `column` over the steps (ratios and params: {run label:
    table}), after a learning-rate panel and a loss panel (when a run logged one), all on the step axis. Weight
    panels share their y range so that layers compare too."""
    labels = list(ratios)
    colours = {label: RUN_COLOURS[i % len(RUN_COLOURS)] for i, label in enumerate(labels)}
    spread = spread or {}
    most_different = sorted(keys, key=lambda k: -(spread.get(k, 0) if spread.get(k, 0) == spread.get(k, 0) else 0))
    chosen = pick_panels(keys, set(priority) | set(most_different[:COMPARE_MAX_PANELS // 2]), COMPARE_MAX_PANELS)
    losses = {label: scalar_series((scalars or {}).get(label), schema.SCALAR_LOSS) for label in labels}
    context = [("learning rate", {label: lr_series(ratios[label], params[label]) for label in labels})]
    if any(losses.values()):
        context.append(("loss", losses))
    n = len(context) + max(1, len(chosen))
    ncols = min(n, 4 if n <= 12 else 6)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.1 * ncols + 0.4, 2.2 * nrows + 1.2), squeeze=False,
                             layout="constrained")
    flat = list(axes.flat)
    all_steps = []
    for ax, (name, per_run) in zip(flat, context):
        for label, series in per_run.items():
            for i, (series_label, (steps, values)) in enumerate(series.items()):
                _plot_series(ax, steps, values, color=colours[label], linewidth=1.1,
                             linestyle=GROUP_LINE_STYLES[i % len(GROUP_LINE_STYLES)][0],
                             drawstyle="steps-post" if name == "learning rate" else "default")
                all_steps.append(steps)
        _log_scale_if_spread(ax, [v for series in per_run.values() for _, v in series.values()])
        several = [list(s) for s in per_run.values() if len(s) > 1] if name == "learning rate" else []
        styles = ", ".join(f"{style}: {group}" for (_, style), group in zip(GROUP_LINE_STYLES, several[0])) \
            if several else ""
        ax.set_title(name + (f" ({styles})" if styles else ""), fontsize=8)
    weight_axes = flat[len(context):len(context) + len(chosen)]
    drawn = []
    for ax, key in zip(weight_axes, chosen):
        for label in labels:
            df = ratios[label]
            df = df[(df["optimizer"] == key[0]) & (df["param"] == key[1])].sort_values("step")
            values = df[column].to_numpy(dtype=float, copy=True)
            values[~np.isfinite(values)] = np.nan
            keep = np.isfinite(values)
            if keep.any():
                _plot_series(ax, df["step"].to_numpy()[keep], values[keep], color=colours[label], linewidth=1.1)
                drawn.append(values[keep])
                all_steps.append(df["step"].to_numpy())
        if guide is not None:
            ax.axhline(guide, color="k", linestyle="--", linewidth=0.8)
        if thresholds is not None:
            for bound, status in ((thresholds.high, "HIGH"), (thresholds.low, "LOW")):
                ax.axhline(bound, color=STATUS_COLOURS[status], linestyle=":", linewidth=0.8)
        flagged = key in priority
        ax.set_title(short_name(key[1], 34) + (" [flagged]" if flagged else ""), fontsize=7.5,
                     color=STATUS_COLOURS["HIGH"] if flagged else "black", fontweight="bold" if flagged else "normal")
    if drawn:
        pooled = np.concatenate(drawn)
        lo, hi = np.percentile(pooled, [1, 99])
        for value in (guide, *((thresholds.low, thresholds.high) if thresholds is not None else ())):
            if value is not None:
                lo, hi = min(lo, value), max(hi, value)
        pad = max(0.1, (hi - lo) * 0.06)
        for ax in weight_axes:
            ax.set_ylim(lo - pad, hi + pad)
    if not chosen:
        _no_data(flat[len(context)], "no weights in any run")
    steps = np.concatenate(all_steps) if all_steps else np.zeros(0)
    for i, ax in enumerate(flat):
        if i >= len(context) + max(1, len(chosen)):
            ax.axis("off")
            continue
        ax.tick_params(labelsize=6.5)
        ax.grid(alpha=0.3)
        if len(steps):
            _integer_steps(ax, steps)
    for col in range(ncols):
        lowest = max(i for i in range(col, n, ncols))
        flat[lowest].set_xlabel("optimizer step", fontsize=8)
    for i in range(0, n, ncols):
        flat[i].set_ylabel(context[i][0] if i < len(context) else f"{quantity_label(column)} (log10)", fontsize=8)
    handles = [plt.Line2D([], [], color=colours[label], linewidth=2) for label in labels]
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    shown = f"; {len(chosen)} of {len(keys)} weights (flagged, most different, an even spread)" \
        if len(chosen) < len(keys) else ""
    title = f"{quantity_label(column)} per weight, runs overlaid{shown}"
    fig.suptitle("\n".join(textwrap.wrap(title, int(fig.get_figwidth() * 10))), fontsize=10, x=0.01, ha="left")
    return fig
