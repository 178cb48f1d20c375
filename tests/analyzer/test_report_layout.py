"""The HTML report as a reader sees it: no placeholder figures, each param group's own values, and (in a real
headless Chromium, skipped where none is installed) a layout that fits a 1400 px window with readable figures."""
import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch
from torch import nn

import upd
from upd.analyzer import plots, report
from upd.analyzer.report import NO_HISTOGRAMS, param_groups_of, report_html

from tests.harness.analysis_runs import record_deep
from tests.harness.training import train_steps

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
WINDOW = (1400, 900)


def _two_group_adamw(path, steps=3, prefix="", layers=2):
    """AdamW with weight decay 0.1 on the weights and 0 on the biases (the constructor's default is 0.01)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    for i in range(layers):
        model.add_module(f"{prefix}fc{i}", nn.Linear(64 if i == 0 else 20, 20))
        model.add_module(f"act{i}", nn.Tanh())
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                            lr=1e-3)
    with upd.record(path, model, opt, every=1):
        for _ in range(steps):
            x = torch.randn(8, 64)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    return str(path)


def _report(path, verify=False):
    analysis = upd.analyze(path, plots=True)
    with upd.open_run(path) as run:
        description, groups = run.describe(), param_groups_of(run)
    return analysis, report_html(analysis, description, groups=groups,
                                 verify_report=upd.verify(path) if verify else None)


@pytest.mark.slow  # records and draws: several seconds
def test_statistics_only_run_draws_no_placeholder_histograms_and_says_why(tmp_path):
    path = record_deep(tmp_path / "stats.h5", n_layers=3, steps=4, every=None, stats_every=1)
    analysis, text = _report(path)
    assert set(analysis.images) == {"update_to_data.png", "grad_to_data.png"}  # no empty histogram boxes
    assert "no full-tensor record of a weight: no histograms" in analysis.notes
    assert text.count("<img") == 2 and NO_HISTOGRAMS in text
    assert "at step  (" not in text


@pytest.mark.slow
def test_metadata_shows_each_param_groups_own_values(tmp_path):
    _, text = _report(_two_group_adamw(tmp_path / "groups.h5"))
    row = re.search(r"<tr><td[^>]*>weight_decay</td>(.*?)</tr>", text).group(1)
    assert re.findall(r">([^<]*)</td>", row) == ["0.1", "0"]
    assert "0.01" not in text.split("<h2>Run</h2>")[1]  # the constructor's default, which no group used


def test_hyperparameters_show_as_a_person_would_write_them():
    """A scheduled lr of 0.1 * 0.1 reads 0.01 (7 significant digits), in lists too; changed values as first -> last."""
    table = report.group_table([{"lr": 0.1, "betas": [0.9, 0.999], "foreach": None, "amsgrad": False}],
                               [{"lr": 0.1 * 0.1, "betas": [0.9, 0.999], "foreach": None, "amsgrad": False}])
    assert table.set_index("hyperparameter")["group 0"].to_dict() == {
        "lr": "0.1 \u2192 0.01", "betas": "[0.9, 0.999]", "amsgrad": "false"}


def _layout(html_path, screenshot):
    """Open the report in headless Chromium at WINDOW; returns what a script measured there (the page's and each
    table's widths, each figure's shown scale) and writes a screenshot."""
    probe = """<script>window.addEventListener('load', () => {
      const boxes = [...document.querySelectorAll('table')].map(t => {
        const box = t.parentElement, r = t.getBoundingClientRect(), b = box.getBoundingClientRect();
        return {right: r.right, box_right: b.right, scrolls: box.scrollWidth > box.clientWidth &&
                getComputedStyle(box).overflowX === 'auto'};
      });
      const images = [...document.querySelectorAll('img')].map(i => ({alt: i.alt, scale: i.clientWidth / i.naturalWidth}));
      document.title = JSON.stringify({page: document.documentElement.scrollWidth, window: window.innerWidth,
                                       tables: boxes, images: images});
    });</script>"""
    text = open(html_path, encoding="utf-8").read()
    probed = html_path + ".probe.html"
    with open(probed, "w", encoding="utf-8") as f:
        f.write(text.replace("</body>", probe + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
             f"--window-size={WINDOW[0]},{WINDOW[1]}"]
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}", "--dump-dom", "file://" + probed],
                             capture_output=True, text=True, timeout=120).stdout
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}", f"--screenshot={screenshot}",
                        "file://" + html_path], capture_output=True, timeout=120)
    title = re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    return json.loads(title.replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_report_fits_a_1400_px_window_in_a_real_browser(tmp_path):
    long_prefix = "transformer_h11_attention_output_dense_projection_"  # names as long as real models'
    path = _two_group_adamw(tmp_path / "wide.h5", prefix=long_prefix, layers=10)  # 10 histogram panels
    _, text = _report(path, verify=True)
    html_path = str(tmp_path / "report.html")
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(text)
    screenshot = str(tmp_path / "report.png")
    found = _layout(html_path, screenshot)
    assert os.path.getsize(screenshot) > 10_000  # the screenshot to look at (benchmarks/report_screenshot.py)
    assert found["page"] <= found["window"], found  # nothing wider than the window: no page-wide scrollbar
    for table in found["tables"]:  # each table fits its own box, or scrolls inside it
        assert table["right"] <= table["box_right"] + 1 or table["scrolls"], found
    for image in found["images"]:  # figures drawn for the page's width: shown at about their own size
        shown_px = image["scale"] * plots.HISTOGRAM_FONT * plots.DPI / 72
        assert shown_px >= 10, found  # a histogram's tick labels at least 10 px high on screen
