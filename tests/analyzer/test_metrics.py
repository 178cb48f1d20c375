"""The RMS and spectral update:data ratios against their definitions (upd/ratios.py), and on a real run."""
import math

import numpy as np
import pytest
import torch

import upd
from tests.harness.training import MLP

from upd.torch_threads import one_torch_thread
from upd.ratios import POWER_ITERATIONS, rms_update_to_data, spectral_norm, spectral_update_to_data

# Power iteration converges from below at the rate (sigma_2/sigma_1)^(2k): i.i.d. Gaussian matrices, whose top
# singular values nearly tie, are its worst case; POWER_ITERATIONS (30) stays within 3% there (measured: at most
# 1.4% on the shapes below); low-rank matrices have a wide gap below sigma_1 and land within 1e-6 (rank 1: exact).
GAUSSIAN_RTOL = 0.03
LOW_RANK_RTOL = 1e-6


def exact(a: torch.Tensor) -> float:
    with one_torch_thread():  # a small SVD: torch's thread pool costs more than it saves on a busy machine
        return float(torch.linalg.matrix_norm(a.double(), ord=2))


@pytest.mark.parametrize("shape", [(50, 30), (3, 200), (64, 64), (128, 128), (64, 256)])
def test_spectral_norm_on_random_matrices(shape):
    torch.manual_seed(sum(shape))
    for _ in range(3):
        a = torch.randn(shape)
        got = spectral_norm(a)
        assert got <= exact(a) * (1 + 1e-12)  # a lower bound
        assert got == pytest.approx(exact(a), rel=GAUSSIAN_RTOL)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_spectral_norm_on_low_rank_matrices(rank):
    torch.manual_seed(rank)
    a = torch.randn(80, rank) @ torch.randn(rank, 120)
    assert spectral_norm(a) == pytest.approx(exact(a), rel=LOW_RANK_RTOL)


def test_the_tolerance_is_tight_enough_to_fail():
    """Too few iterations miss the Gaussian tolerance: the test above can fail."""
    torch.manual_seed(64 + 64)
    a = torch.randn(256, 256)
    assert spectral_norm(a, iterations=2) < exact(a) * (1 - GAUSSIAN_RTOL)
    assert POWER_ITERATIONS > 2


def test_spectral_ratio_of_a_kernel_and_of_a_vector():
    torch.manual_seed(0)
    w = torch.randn(8, 3, 3, 3)
    dw = 1e-3 * torch.randn(8, 3, 3, 3)
    want = math.log10(exact(dw.reshape(8, -1)) / exact(w.reshape(8, -1)))
    assert spectral_update_to_data(w, w + dw) == pytest.approx(want, abs=0.013)  # log10(1.03)
    assert math.isnan(spectral_update_to_data(torch.randn(5), torch.randn(5)))
    assert spectral_update_to_data(w, w.clone()) == -math.inf  # did not move


def test_rms_ratio_is_its_definition():
    torch.manual_seed(0)
    w, dw = torch.randn(30, 20).double(), 1e-3 * torch.randn(30, 20).double()
    rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
    want = math.log10(rms(dw) / rms(w))
    got = float(rms_update_to_data(float(torch.linalg.vector_norm(dw)), float(torch.linalg.vector_norm(w))))
    assert got == pytest.approx(want, abs=1e-12)
    shifted = dw + 1e-2  # the RMS ratio counts a shift of the mean, the std ratio does not
    assert rms_update_to_data(float(shifted.norm()), float(w.norm())) > got + 0.5
    assert np.array_equal(rms_update_to_data(np.array([0.0, 1.0]), np.array([1.0, 0.0])), [-np.inf, np.inf])


@pytest.mark.slow
def test_analyze_shows_both_metrics(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with upd.record(tmp_path / "run.h5", model, opt, every=1):
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
    result = upd.analyze(tmp_path / "run.h5")
    with upd.open_run(tmp_path / "run.h5") as run:
        p = run.param(result.summary["param"][0])
        before, after = p.read("param", slice(0, 1))[0], p.read("param_after", slice(0, 1))[0]
    row = result.metrics[(result.metrics["param"] == p.name) & (result.metrics["step"] == 0)].iloc[0]
    assert row["spectral_update_to_data"] == pytest.approx(spectral_update_to_data(before, after))
    assert row["rms_update_to_data"] == pytest.approx(math.log10(float((after - before).norm() / before.norm())))
    assert {"median_rms_update_to_data", "median_spectral_update_to_data"} <= set(result.summary.columns)
    assert not [n for n in result.notes if n.startswith("spectral medians")]  # full records at every step
    with upd.record(tmp_path / "sparse.h5", model, opt, every=2, stats_every=1):  # full records at steps 4 and 6
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
    notes = [n for n in upd.analyze(tmp_path / "sparse.h5").notes if n.startswith("spectral medians")]
    assert notes == ["spectral medians over the 2 step(s) with full-tensor records (it needs whole matrices); the "
                     "std and rms medians over all 4 steps"]
