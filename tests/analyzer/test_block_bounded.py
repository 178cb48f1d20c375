"""analyze reads a parameter larger than a block a block of elements at a time (ratios and histogram samples), and
gets what reading whole rows gets: checked on a real recorded run with tiny blocks, and shown to fail when a block
is dropped or read twice."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import upd
from upd.analyzer import plots
from upd.runfile.ratio_table import CANCELLATION
from upd.runfile import tensor_blocks
from upd.runfile.reader import ParamRecord

WIDE = 300  # the weight: 300x300 = 90,000 numbers a row, more than one SUM_CHUNK (the long-row sums)
ELEMENTS = 7_000  # a tiny block: the weight's rows are read in 13 parts, none aligned to a SUM_CHUNK
TINY_BLOCK_BYTES = 3 * 4 * ELEMENTS  # run.ratios(block_bytes=...) giving ELEMENTS per kind and read


class Model(nn.Module):
    """A real layer, a nearly constant scale (its sums cancel: the two-pass std), and a tensor whose gradient turns
    infinite at one step (its NaN/Inf elements are counted)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDE, WIDE)
        self.scale = nn.Parameter(1000 + 1e-3 * torch.randn(80_000))
        self.spiky = nn.Parameter(torch.randn(70_000))

    def forward(self, x):
        return (self.lin(x) * self.scale[:WIDE] / 1000).pow(2).mean() + (self.spiky * self.spiky).mean()


@pytest.fixture(scope="module")
def run_path(tmp_path_factory):
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    path = str(tmp_path_factory.mktemp("blocks") / "run.h5")
    with upd.record(path, model, opt, every=1):
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(16, WIDE)).backward()
            if step == 1:
                model.spiky.grad[123] = math.inf  # a non-finite gradient element: counted block by block
            opt.step()
    return path


def _ratios(path, block_bytes):
    with upd.open_run(path) as run:
        return run.ratios(block_bytes=block_bytes)


def test_several_blocks_per_row(run_path):
    with upd.open_run(run_path) as run:
        for name in ("lin.weight", "scale", "spiky"):
            assert len(tensor_blocks.element_blocks(run.param(name).stored_shape("param"), ELEMENTS)) > 5


def test_tiny_blocks_give_the_whole_row_table(run_path):
    whole, blocked = _ratios(run_path, upd.runfile.reader.DEFAULT_BLOCK_BYTES), _ratios(run_path, TINY_BLOCK_BYTES)
    # The sums are the same bits however a row is split (RowSums); only the rare two-pass std of a row whose sums
    # cancel (the nearly constant scale) is computed another way: equal to float64 rounding.
    pd.testing.assert_frame_equal(whole, blocked, check_exact=False, rtol=1e-12, atol=0)
    exact = whole["param"] != "scale"
    pd.testing.assert_frame_equal(whole[exact], blocked[exact], check_exact=True)
    by = blocked.set_index(["param", "step"])
    assert by.loc[("spiky", 1), "grad_nonfinite"] == 1 and by.loc[("spiky", 1), "flag"] == "nonfinite-grad"
    assert by.loc[("spiky", 0), "grad_nonfinite"] == 0
    # the scale's sums did cancel (a one-pass std would be noise), and the two-pass std is its real spread
    scale = by.loc[("scale", 0)]
    assert scale["param_std"] == pytest.approx(1e-3, rel=0.05)
    assert scale["param_std"] ** 2 * (80_000 - 1) <= CANCELLATION * scale["param_norm"] ** 2


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["drop", "double"])
def test_a_lost_or_repeated_block_is_caught(run_path, monkeypatch, mistake):
    """The comparison above fails when the blocked reading drops a block or reads one twice."""
    whole = _ratios(run_path, upd.runfile.reader.DEFAULT_BLOCK_BYTES)
    original = tensor_blocks.element_blocks

    def wrong(shape, limit, whole_rows=False):
        parts = original(shape, limit, whole_rows)
        return parts[:2] + parts[3:] if mistake == "drop" else parts[:3] + parts[2:]

    monkeypatch.setattr(tensor_blocks, "element_blocks", wrong)
    blocked = _ratios(run_path, TINY_BLOCK_BYTES)
    with pytest.raises(AssertionError):
        pd.testing.assert_frame_equal(whole, blocked, check_exact=False, rtol=1e-12, atol=0)
    changed = whole.index[~np.isclose(whole["param_norm"], blocked["param_norm"], rtol=1e-12, atol=0)]
    assert set(whole.loc[changed, "param"]) == {"lin.weight", "scale", "spiky"}


def _histogram_samples(path, block_elements):
    with upd.open_run(path) as run:
        p = run.param("lin.weight")
        return [plots.row_sample(p, kind, row, block_elements) for kind in ("param", "grad") for row in range(3)]


def test_histogram_samples_read_in_blocks_are_the_whole_rows(run_path, monkeypatch):
    monkeypatch.setattr(plots, "HISTOGRAM_SAMPLE", 1_000)  # a strided sample (every 90th number), like a big weight
    with upd.open_run(run_path) as run:
        p = run.param("lin.weight")
        whole = [plots._sample(p.read(kind, row)) for kind in ("param", "grad") for row in range(3)]
    assert all(len(w) == 1_000 for w in whole)
    for w, b in zip(whole, _histogram_samples(run_path, ELEMENTS)):
        assert np.array_equal(w, b)
    original = tensor_blocks.element_blocks
    monkeypatch.setattr(tensor_blocks, "element_blocks", lambda *a: (lambda parts: parts[:2] + parts[3:])(original(*a)))
    assert not any(np.array_equal(w, b) for w, b in zip(whole, _histogram_samples(run_path, ELEMENTS)))


@pytest.mark.slow
def test_analyze_reads_at_most_a_block_of_a_large_parameter(run_path, monkeypatch):
    """The whole analysis (ratios, summary, figures) with verify's block shrunk to ELEMENTS: every read of a
    parameter larger than that is at most ELEMENTS numbers, and the result is the whole-row one."""
    expected = upd.analyze(run_path, plots=True)
    reads = []
    read_part, read = ParamRecord.read_part, ParamRecord.read

    def counted_read_part(self, kind, rows, elements=()):
        out = read_part(self, kind, rows, elements)
        reads.append((self.name, out.numel()))
        return out

    def counted_read(self, kind, rows=slice(None)):
        out = read(self, kind, rows)
        reads.append((self.name, out.numel()))
        return out

    monkeypatch.setattr(ParamRecord, "read_part", counted_read_part)
    monkeypatch.setattr(ParamRecord, "read", counted_read)
    monkeypatch.setattr(tensor_blocks, "BLOCK_ELEMENTS", ELEMENTS)
    got = upd.analyze(run_path, plots=True)
    large = [n for name, n in reads if name in ("lin.weight", "scale", "spiky")]
    assert large and max(large) <= ELEMENTS
    # The spectral ratio needs a whole matrix in memory: a weight larger than the block gets none (and a note).
    spectral = "median_spectral_update_to_data"
    assert got.summary.loc[got.summary["param"] == "lin.weight", spectral].isna().all()
    assert np.isfinite(expected.summary.loc[expected.summary["param"] == "lin.weight", spectral]).all()
    assert any(n.startswith("spectral ratio not computed for 1 weight(s)") and "lin.weight" in n for n in got.notes)
    pd.testing.assert_frame_equal(expected.summary.drop(columns=[spectral]), got.summary.drop(columns=[spectral]),
                                  check_exact=False, rtol=1e-12, atol=0)
    pd.testing.assert_frame_equal(expected.ratios, got.ratios, check_exact=False, rtol=1e-12, atol=0)
    assert got.images.keys() == expected.images.keys()
