"""The HTML report: one self-contained file, every file-derived text escaped."""
import base64
import re
from html.parser import HTMLParser

import torch
from torch import nn

import upd
from upd.analyzer.report import report_html, write_report

from tests.harness.paths import SAMPLE_RUNS

ADAM = [p for p in SAMPLE_RUNS if p.endswith("/adam.h5")][0]
HOSTILE = '<img src=x onerror="alert(1)">'


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.srcs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.srcs += [v for k, v in attrs if k in ("src", "href")]


def _parse(text):
    parser = _Tags()
    parser.feed(text)
    return parser


def test_report_is_self_contained_with_figures_table_metadata_and_verify(tmp_path):
    analysis = upd.analyze(ADAM, plots=True)
    with upd.open_run(ADAM) as run:
        description = run.describe()
    report = upd.verify(ADAM)
    path = write_report(tmp_path / "r.html", analysis, description, verify_report=report)
    text = open(path, encoding="utf-8").read()
    parsed = _parse(text)
    assert "script" not in parsed.tags and "link" not in parsed.tags  # nothing to fetch, nothing to run
    assert len(parsed.srcs) == 4 and all(s.startswith("data:image/png;base64,") for s in parsed.srcs)
    for src in parsed.srcs:  # real PNGs, the same bytes the analysis drew
        assert base64.b64decode(src.split(",", 1)[1]) in analysis.images.values()
    assert "update:data (last step)" in text and "fc2.weight" in text and "20x64" in text
    assert "all weights within [-4.5, -1.5]" in text
    assert "80 step-parameter checks matched" in text and "torch.optim.Adam" in text
    assert description["torch_version"] in text
    # Without verify and without figures: neither section.
    bare = report_html(upd.analyze(ADAM), description)
    assert "Verify" not in bare and "data:image" not in bare and "fc2.weight" in bare


def test_parameter_names_from_the_file_are_escaped(tmp_path):
    model = nn.Module()
    model.add_module(HOSTILE, nn.Linear(4, 3))  # a module name is any string without a dot
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "hostile.h5")
    with upd.record(path, model, opt, every=1):
        for _ in range(2):
            opt.zero_grad()
            getattr(model, HOSTILE)(torch.randn(2, 4)).sum().backward()
            opt.step()
    analysis = upd.analyze(path, plots=True, thresholds=upd.Thresholds(high=-9, low=-10))  # flagged: in the verdict
    with upd.open_run(path) as run:
        assert f"{HOSTILE}.weight" in list(run.params()["param"])
        text = report_html(analysis, run.describe(), notes=[f"note about {HOSTILE}"])
    assert HOSTILE not in text and "<img src=x" not in text
    assert text.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;.weight") >= 2  # the table and the verdict
    assert [t for t in _parse(text).tags if t == "img"] == ["img"] * 4  # only the four figures
    assert re.search(r"note about &lt;img", text)
