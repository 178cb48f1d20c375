"""Statistics estimated from samples (``upd.record(stats_sample=K)``) on real training runs: the estimator computes
what it says from the positions it says, it stays within the error its sample size predicts of the exact statistics,
tensors of at most K elements are exact bit for bit, the gradient's norm and NaN/Inf flag stay exact, the option is
checked, and the file and the analyzer say the statistics are estimates."""
import math
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd.analyzer.clipping import summarize_clipping
from upd.cli import main
from upd.recorder import sampled_stats
from upd.recorder.device_stats import LEAN_COLUMNS
from upd.runfile import schema

K = 1024  # the sample size under test; the model has tensors above it, at it and below it
STEPS = 6
SAMPLED = ("0.weight", "2.weight")  # 64 x 256 and 256 x 64: 16384 elements each
EXACT_AT_K = "4.weight"  # 16 x 64 = K elements: exact


def make_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 16))
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert all(sizes[n] > K for n in SAMPLED) and sizes[EXACT_AT_K] == K
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)) for _ in range(STEPS)]


def train(path, capture=None, grad_hook=None, **options):
    """STEPS AdamW steps of make_model, recorded statistics-only (the lean set at every step); `capture` gets each
    parameter's values before the step, its gradient and its update, as the optimizer saw them."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=None, strict=True, **options):
        for step, (x, y) in enumerate(batches()):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if grad_hook is not None:
                grad_hook(step, dict(model.named_parameters()))
            before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
            opt.step()
            if capture is not None:
                for n, p in model.named_parameters():
                    capture[(n, step)] = (before[n][0], before[n][1], p.detach() - before[n][0])
    with upd.open_run(path) as run:
        return run.stats().set_index(["param", "step"]).sort_index(), run.options


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampled")
    tensors = {}
    exact, _ = train(str(folder / "exact.h5"), capture=tensors)
    sampled, options = train(str(folder / "sampled.h5"), stats_sample=K)
    return {"exact": exact, "sampled": sampled, "options": options, "tensors": tensors, "folder": folder}


# -- the estimator computes the statistics of its sample -------------------------------------------------------------
def sample_reference(param, grad, update, positions) -> dict:
    """The sampled statistics of one tensor, recomputed here in float64 from the sample positions (docs: norms
    scaled by sqrt(n/K); the gradient's norm exact and its std from that norm and the sample's mean unless the
    sample says |mean| > std)."""
    out = {}
    for kind, t in (("param", param), ("grad", grad), ("update", update)):
        x = t.double().flatten()
        s = x[torch.from_numpy(positions)]
        n, k = x.numel(), s.numel()
        out[f"{kind}_mean"] = s.mean().item()
        out[f"{kind}_std"] = s.std().item()
        out[f"{kind}_norm"] = (s.norm() * math.sqrt(n / k)).item()
        if kind == "grad":
            out["grad_norm"] = x.norm().item()
            if s.mean().item() ** 2 <= s.var().item():
                out["grad_std"] = math.sqrt(max(x.norm().item() ** 2 - n * s.mean().item() ** 2, 0) / (n - 1))
    return out


def matches_sample_reference(table, tensors, keys) -> list:
    wrong = []
    for j, name in enumerate(SAMPLED):
        n = tensors[(name, 0)][0].numel()
        positions = sampled_stats.sample_positions(n, K, key=keys[j])
        for step in range(STEPS):
            for column, ref in sample_reference(*tensors[(name, step)], positions).items():
                got = table.loc[(name, step), column]
                if not math.isclose(got, ref, rel_tol=1e-5, abs_tol=1e-9):
                    wrong.append((name, step, column, got, ref))
    return wrong


def test_sampled_statistics_are_those_of_the_sample_positions(runs):
    assert not matches_sample_reference(runs["sampled"], runs["tensors"], [(0,), (1,)])
    # The comparison can fail: the same statistics read at other positions (another tensor's) are not these.
    assert matches_sample_reference(runs["sampled"], runs["tensors"], [(1,), (0,)])


# -- and stays within the error its sample size predicts of the exact statistics --------------------------------------
def log10_std_error(t: torch.Tensor, block: int = sampled_stats.BLOCK) -> float:
    """The standard error of log10(std) estimated from K of t's elements in blocks of `block`: the relative error of a
    sample variance is sqrt((kurtosis - 1) * design_effect / K) (delta method: half that for the std), where the
    design effect counts what blocks of neighbours share (block x the variance of block means of the squared
    deviations over their variance; 1 for independent elements, `block` for identical neighbours)."""
    x = t.double().flatten()
    d = (x - x.mean()) ** 2
    kurtosis = (d * d).mean() / d.mean() ** 2
    blocks = d[: d.numel() // block * block].view(-1, block)
    design_effect = max(1.0, (block * blocks.mean(1).var() / d.var()).item())
    return 0.5 * math.sqrt((kurtosis.item() - 1) * design_effect / K) / math.log(10)


def outside_tolerance(exact, sampled, tensors, z=4.0) -> list:
    """Rows whose ratio errors exceed z standard errors (the errors of the two stds added: both come from the same
    positions)."""
    out = []
    for name in SAMPLED:
        for step in range(STEPS):
            param, grad, update = tensors[(name, step)]
            se_param = log10_std_error(param)
            for column, other in (("update_to_data", update), ("grad_to_data", grad)):
                error = abs(sampled.loc[(name, step), column] - exact.loc[(name, step), column])
                tolerance = z * (se_param + log10_std_error(other))
                if not error <= tolerance:
                    out.append((name, step, column, error, tolerance))
    return out


def test_sampled_ratios_are_within_the_error_the_sample_size_predicts(runs):
    exact, sampled, tensors = runs["exact"], runs["sampled"], runs["tensors"]
    assert not outside_tolerance(exact, sampled, tensors)
    # Some error there is (these are estimates), and a value off by twice the tolerance is caught.
    assert (sampled.loc[list(SAMPLED), "update_to_data"] != exact.loc[list(SAMPLED), "update_to_data"]).all()
    name = SAMPLED[0]
    param, grad, update = tensors[(name, 3)]
    corrupted = sampled.copy()
    corrupted.loc[(name, 3), "update_to_data"] += 2 * 4.0 * (log10_std_error(param) + log10_std_error(update))
    assert [(n, s, c) for n, s, c, _, _ in outside_tolerance(exact, corrupted, tensors)] == \
        [(name, 3, "update_to_data")]


def test_a_sample_too_small_for_its_claimed_size_fails_the_tolerance(runs, monkeypatch, tmp_path):
    """Positions that repeat 16 contiguous elements K/16 times: statistics of 16 elements passed off as K. The
    tolerance for K elements rejects them."""
    def sixteen_elements(n, sample, block=sampled_stats.BLOCK, key=()):
        start = np.random.default_rng([sampled_stats.SEED, n, *key]).integers(n - 16)
        return np.tile(start + np.arange(16), sample // 16)
    monkeypatch.setattr(sampled_stats, "sample_positions", sixteen_elements)
    sampled, _ = train(str(tmp_path / "one-block.h5"), stats_sample=K)
    assert outside_tolerance(runs["exact"], sampled, runs["tensors"])


# -- what stays exact ----------------------------------------------------------------------------------------------
def test_tensors_up_to_the_sample_size_are_exact_bit_for_bit(runs):
    exact, sampled = runs["exact"], runs["sampled"]
    small = [n for n in exact.index.get_level_values("param").unique() if n not in SAMPLED]
    assert EXACT_AT_K in small and len(small) == 4
    for column in LEAN_COLUMNS:
        assert np.array_equal(sampled.loc[small, column].to_numpy(), exact.loc[small, column].to_numpy(),
                              equal_nan=True), column


def test_gradient_norms_and_the_clipping_check_stay_exact(runs, tmp_path):
    exact, sampled = runs["exact"], runs["sampled"]
    np.testing.assert_allclose(sampled["grad_norm"], exact["grad_norm"], rtol=1e-6)
    assert not np.allclose(sampled.loc[list(SAMPLED), "param_norm"], exact.loc[list(SAMPLED), "param_norm"],
                           rtol=1e-6)  # the parameter's norm is an estimate (the control)
    # The step's total gradient norm, which the clipping check compares with the backward pass's: equal, unclipped.
    with upd.open_run(str(runs["folder"] / "sampled.h5")) as run:
        scalars = run.scalars()
    np.testing.assert_allclose(scalars[schema.SCALAR_GRAD_NORM_AT_STEP], scalars[schema.SCALAR_GRAD_NORM_BACKWARD],
                               rtol=1e-6)
    summary, = summarize_clipping(scalars)
    assert summary.measured_steps == STEPS and summary.clipped_steps == 0


def test_a_nan_in_a_gradient_outside_the_sample_is_counted(runs, tmp_path):
    name = SAMPLED[1]
    n = runs["tensors"][(name, 0)][0].numel()
    taken = set(sampled_stats.sample_positions(n, K, key=(1,)).tolist())
    outside = next(i for i in range(n) if i not in taken)

    def poison(step, params):
        if step == 2:
            params[name].grad.view(-1)[outside] = float("nan")
    sampled, _ = train(str(tmp_path / "nan.h5"), grad_hook=poison, stats_sample=K)
    assert sampled.loc[(name, 2), "grad_nonfinite"] == 1.0  # exact count, though the sample holds no NaN
    assert math.isnan(sampled.loc[(name, 2), "grad_norm"])
    assert sampled.loc[(name, 1), "grad_nonfinite"] == 0.0 and sampled.loc[(SAMPLED[0], 2), "grad_nonfinite"] == 0.0


# -- the option, the file and the analyzer -------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 255, -4096, True, 4096.0, "4096"])
def test_a_bad_sample_size_is_refused(value, tmp_path):
    with pytest.raises(ValueError, match=r"stats_sample must be a number of elements >= 256 or None"):
        upd.record(str(tmp_path / "run.h5"), make_model(), None, every=None, stats_every=1, stats_sample=value)
    assert not (tmp_path / "run.h5").exists()


def test_the_launcher_refuses_it_with_the_same_message(tmp_path):
    result = CliRunner().invoke(main, ["record", str(tmp_path / "run.h5"), "--stats-every", "1", "--stats-sample",
                                       "100", "--", "python", "x.py"])
    assert result.exit_code == 2 and result.output.startswith("upd: error: stats_sample must be a number of "
                                                              "elements >= 256 or None"), result.output
    ok = CliRunner().invoke(main, ["record", "--help"])
    assert "--stats-sample" in ok.output


def test_the_file_and_the_analyzer_say_the_statistics_are_estimates(runs):
    assert runs["options"]["stats_sample"] == K
    sampled, exact = str(runs["folder"] / "sampled.h5"), str(runs["folder"] / "exact.h5")
    notes = upd.analyze(sampled).notes
    assert any(f"estimated from a sample of {K} elements" in note for note in notes), notes
    assert not any("estimated from a sample" in note for note in upd.analyze(exact).notes)
    info = CliRunner().invoke(main, ["info", sampled])
    assert info.exit_code == 0 and f"stats_sample={K}" in info.output
    assert "stats_sample=" not in CliRunner().invoke(main, ["info", exact]).output


@pytest.mark.slow
def test_the_ratio_figures_say_the_statistics_are_estimates(runs, monkeypatch):
    from upd.analyzer import plots

    titles = {}
    drawn = plots.ratio_figure

    def ratio_figure(ratios, params, column, *, title, **kwargs):
        titles[(len(titles) // 2, column)] = title
        return drawn(ratios, params, column, title=title, **kwargs)
    monkeypatch.setattr(plots, "ratio_figure", ratio_figure)
    for name in ("sampled", "exact"):
        upd.analyze(str(runs["folder"] / f"{name}.h5"), plots=True)
    estimated = f"estimated from {K} elements of each larger tensor"
    assert [estimated in title for title in titles.values()] == [True, True, False, False], titles


class MixedPrecision(nn.Module):
    """A float64 layer and a bfloat16 one (4096 elements: sampled at K=1024): gathered and normed per dtype."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(64, 256).double()
        self.narrow = nn.Linear(256, 16).to(torch.bfloat16)

    def forward(self, x):
        return self.narrow(torch.tanh(self.wide(x.double())).to(torch.bfloat16)).float()


def test_parameters_of_several_dtypes_are_sampled_in_their_own(tmp_path):
    tables = {}
    for label, options in (("exact", {}), ("sampled", {"stats_sample": K})):
        model = MixedPrecision()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        captured = {}
        with upd.record(str(tmp_path / f"{label}.h5"), model, opt, every=None, stats_every=1, full_stats_every=None,
                        strict=True, **options):
            for step in range(2):
                opt.zero_grad()
                model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
                before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
                opt.step()
                # the update in float64, as the sampled path forms it (a bfloat16 difference would be rounded)
                captured.update({(n, step): (*before[n], p.detach().double() - before[n][0].double())
                                 for n, p in model.named_parameters()})
        with upd.open_run(str(tmp_path / f"{label}.h5")) as run:
            tables[label] = run.stats().set_index(["param", "step"]).sort_index()
    np.testing.assert_allclose(tables["sampled"]["grad_norm"], tables["exact"]["grad_norm"], rtol=1e-5)
    for j, name in enumerate(("wide.weight", "narrow.weight")):  # the sampled ones, in optimizer order
        positions = sampled_stats.sample_positions(captured[(name, 0)][0].numel(), K, key=(j,))
        for step in range(2):
            for column, ref in sample_reference(*captured[(name, step)], positions).items():
                assert tables["sampled"].loc[(name, step), column] == pytest.approx(ref, rel=1e-5, abs=1e-9), \
                    (name, step, column)


def ddp_worker(rank, world_size, folder):
    """The same training under DDP (every rank the same batches, so the averaged gradient is the single process's),
    recorded with stats_sample."""
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with upd.record(os.path.join(folder, "job.h5"), model, opt, every=None, stats_every=1, full_stats_every=None,
                    strict=True, stats_sample=K):
        for x, y in batches():
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()


@pytest.mark.slow
def test_a_distributed_job_records_exact_statistics_and_says_so(runs, tmp_path):
    from tests.harness.distributed import run_job
    run_job(ddp_worker, 2, str(tmp_path))
    with upd.open_run(str(tmp_path / "job.h5")) as run:
        options, job = run.options, run.stats().set_index(["param", "step"]).sort_index()
    assert options["stats_sample"] is None
    exact, sampled = runs["exact"], runs["sampled"]
    np.testing.assert_allclose(job["update_to_data"], exact["update_to_data"], rtol=0, atol=1e-4)
    # the control: the sampled run's ratios are further from the exact ones than that
    assert np.abs(sampled.loc[list(SAMPLED), "update_to_data"] - exact.loc[list(SAMPLED), "update_to_data"]).max() \
        > 1e-3
