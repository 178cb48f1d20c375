"""PNG plots of a run, headless (matplotlib Agg). Each function takes data and a path and returns the path."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # never needs a display; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from .summary import Thresholds, is_weight  # noqa: E402


def _weights(ratios: pd.DataFrame, params: pd.DataFrame, all_params: bool) -> list[tuple[int, str]]:
    keep = []
    for r in params.itertuples():
        if all_params or is_weight(r.shape):
            keep.append((r.optimizer, r.param))
    present = set(map(tuple, ratios[["optimizer", "param"]].drop_duplicates().itertuples(index=False)))
    return [k for k in keep if k in present]


def _label(key, multi_opt: bool) -> str:
    return f"opt{key[0]}:{key[1]}" if multi_opt else key[1]


def plot_ratio(ratios: pd.DataFrame, params: pd.DataFrame, column: str, path: str, *, title: str,
               thresholds: Thresholds | None = None, guide: float | None = None, all_params: bool = False) -> str:
    """One line per weight of `column` over optimizer steps, with the guide line (Karpathy's -3) and bounds."""
    fig, ax = plt.subplots(figsize=(11, 5))
    keys = _weights(ratios, params, all_params)
    multi = ratios["optimizer"].nunique() > 1
    for key in keys:
        df = ratios[(ratios["optimizer"] == key[0]) & (ratios["param"] == key[1])].sort_values("step")
        values = df[column].replace([np.inf, -np.inf], np.nan)
        ax.plot(df["step"], values, label=_label(key, multi), linewidth=1)
    if guide is not None:
        ax.axhline(guide, color="k", linestyle="--", linewidth=1, label=f"{guide:g} (guide)")
    if thresholds is not None:
        for bound in (thresholds.high, thresholds.low):
            ax.axhline(bound, color="r", linestyle=":", linewidth=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(column.replace("_", ":").replace(":to:", ":") + " (log10)")
    ax.set_title(title)
    if keys:
        ax.legend(fontsize=7, loc="best", ncol=2 if len(keys) > 8 else 1)
    else:
        ax.text(0.5, 0.5, "no weights with finite ratios recorded", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_histograms(tensors: dict[str, torch.Tensor], path: str, *, title: str, bins: int = 60) -> str:
    """Karpathy-style histograms: one density line per layer, legend with mean and std."""
    fig, ax = plt.subplots(figsize=(11, 4))
    for name, t in tensors.items():
        values = t.detach().double().flatten()
        values = values[torch.isfinite(values)]
        if values.numel() == 0:
            continue
        counts, edges = torch.histogram(values, bins=bins, density=True)
        centers = (edges[:-1] + edges[1:]) / 2
        std = values.std().item() if values.numel() > 1 else float("nan")
        ax.plot(centers.numpy(), counts.numpy(), label=f"{name} (mean {values.mean().item():+.2e}, std {std:.2e})")
    ax.set_title(title)
    if tensors:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render_all(run, ratios: pd.DataFrame, out_dir: str, *, thresholds: Thresholds, hist_step: int | None = None,
               all_params: bool = False) -> list[str]:
    """The standard set: update:data and grad:data over steps, and gradient/weight histograms at one step."""
    os.makedirs(out_dir, exist_ok=True)
    params = run.params()
    paths = [
        plot_ratio(ratios, params, "update_to_data", os.path.join(out_dir, "update_to_data.png"),
                   title="update:data ratio, log10(std(update) / std(weight))", thresholds=thresholds,
                   guide=thresholds.target, all_params=all_params),
        plot_ratio(ratios, params, "grad_to_data", os.path.join(out_dir, "grad_to_data.png"),
                   title="grad:data ratio, log10(std(grad) / std(weight))", all_params=all_params),
    ]
    grads, weights, step = histogram_tensors(run, hist_step, all_params)
    if step is not None:
        paths.append(plot_histograms(grads, os.path.join(out_dir, "grad_histograms.png"),
                                     title=f"gradient distribution at step {step}"))
        paths.append(plot_histograms(weights, os.path.join(out_dir, "weight_histograms.png"),
                                     title=f"weight distribution at step {step}"))
    return paths


def histogram_tensors(run, step: int | None, all_params: bool = False):
    """(grads, weights, step) of every weight at `step` (default: the last recorded step), keyed by name."""
    grads, weights = {}, {}
    chosen = None
    for p in run.iter_params():
        if not (all_params or is_weight(p.shape)) or p.num_rows == 0:
            continue
        steps = p.optimizer.steps[p.records]
        if step is None:
            row = len(steps) - 1
        else:
            hits = np.nonzero(steps == step)[0]
            if not len(hits):
                continue
            row = int(hits[0])
        chosen = int(steps[row]) if chosen is None else chosen
        if "grad" in p.kinds:
            grads[p.name] = p.read("grad", row)
        if "param" in p.kinds:
            weights[p.name] = p.read("param", row)
    return grads, weights, chosen
