"""Statistics mode: per-step summary statistics against a direct reference, one sync per step, cadences."""
import math
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import upd
from upd.ratios import log10_ratio
from upd.recorder import device_stats as stats_mod

from tests.harness.training import MLP, train_steps


def reference_stats(t: torch.Tensor) -> dict:
    x = t.detach().double().flatten()
    n = x.numel()
    finite = torch.isfinite(x)
    return {"mean": x.mean().item(), "std": x.std().item() if n > 1 else math.nan, "norm": x.norm().item(),
            "absmax": x.abs().max().item(), "zero_frac": (x == 0).double().mean().item(),
            "nonfinite": float((~finite).sum())}


LEAN_COLUMNS = [f"{kind}_{stat}" for kind in stats_mod.LEAN_KINDS for stat in stats_mod.LEAN_STATS]


@pytest.mark.parametrize("full_stats_every", [1, None], ids=["full set", "lean set"])
def test_statistics_match_a_direct_reference_computation(tmp_path, full_stats_every):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected = {}
    g = torch.Generator().manual_seed(0)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1, zero_counts=("param", "grad", "update", "state"),
                    full_stats_every=full_stats_every):
        for step in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            before = {n: (p.detach().clone(), p.grad.clone(),
                          {k: v.clone() for k, v in opt.state.get(p, {}).items()}) for n, p in model.named_parameters()}
            opt.step()
            for n, p in model.named_parameters():
                b, grad, state = before[n]
                kinds = {"param": b, "grad": grad, "update": p.detach() - b}
                kinds.update({f"state.{k}": v for k, v in state.items()})
                expected[(n, step)] = {f"{kind}_{s}": v for kind, t in kinds.items()
                                       for s, v in reference_stats(t).items()}
    with upd.open_run(path) as run:
        table = run.stats().set_index(["param", "step"])
        assert run.optimizers[0].num_records == 0  # statistics only: no full tensors at all
        assert run.size_bytes < 200_000
    assert len(table) == len(expected) == 4 * 4
    if full_stats_every is None:  # the lean set: no abs max, zero fraction or optimizer state in the table at all
        assert not [c for c in table.columns if c.endswith(("_absmax", "_zero_frac")) or c.startswith("state.")]
    checked = 0
    for key, values in expected.items():
        for column, ref in values.items():
            if full_stats_every is None and column not in LEAN_COLUMNS:
                continue
            got = table.loc[key, column]
            if math.isnan(ref):
                assert math.isnan(got), (key, column)
            else:
                # float32 precision relative to the tensor's own scale (float32 sums, as torch.Tensor.sum does)
                scale = values[column.rsplit("_", 1)[0].replace("_zero", "") + "_absmax"] if not column.endswith(
                    ("zero_frac", "nonfinite")) else 0.0
                assert got == pytest.approx(ref, rel=2e-6, abs=1e-6 * scale + 1e-12), (key, column, got, ref)
            checked += 1
    # full set: param, grad, update and three Adam state tensors, six statistics each; lean: 3 kinds x 4 statistics
    assert checked == 4 * 4 * len(LEAN_COLUMNS) if full_stats_every is None else checked > 4 * 4 * 30
    row = table.loc[("fc1.weight", 2)]
    assert row["update_to_data"] == pytest.approx(math.log10(row["update_std"] / row["param_std"]))


def test_statistics_and_full_tensors_agree(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1, stats_every=1):
        train_steps(model, opt, steps=5)
    with upd.open_run(path) as run:
        a = run.ratios(source="tensors").set_index(["param", "step"]).sort_index()
        b = run.ratios(source="stats").set_index(["param", "step"]).sort_index()
    assert len(a) == len(b) == 5 * 4
    for column in ("update_to_data", "grad_to_data", "update_std", "param_std", "grad_std", "update_norm",
                   "grad_norm", "param_norm"):
        np.testing.assert_allclose(b[column], a[column], rtol=2e-6, err_msg=column)


def test_cadences_are_independent(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=3, stats_every=2):
        train_steps(model, opt, steps=7)
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].steps) == [0, 3, 6]
        assert sorted(run.stats()["step"].unique()) == [0, 2, 4, 6]
        # auto picks the statistics (more steps); verify still uses the full records
        assert sorted(run.ratios()["step"].unique()) == [0, 2, 4, 6]
    assert upd.verify(path).matched == 3 * 4


def test_one_device_to_host_copy_per_recorded_step(tmp_path, monkeypatch):
    """Count every .cpu()/.item() (and copies to the CPU device) the recorder makes, for 4 and for 40 params."""
    calls = {"cpu": 0, "item": 0}
    real_cpu, real_item = torch.Tensor.cpu, torch.Tensor.item

    def from_upd():  # torch's own Adam calls .item() on its step counters; count only torch-upd's calls
        return "/upd/" in sys._getframe(2).f_code.co_filename

    def counting_cpu(self, *a, **k):
        calls["cpu"] += from_upd()
        return real_cpu(self, *a, **k)

    def counting_item(self, *a, **k):
        calls["item"] += from_upd()
        return real_item(self, *a, **k)

    for layers in (1, 10):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers * 2)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        path = str(tmp_path / f"run{layers}.h5")
        x = torch.randn(4, 6)
        with upd.record(path, model, opt, every=None, stats_every=1):
            for _ in range(3):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                calls.update(cpu=0, item=0)
                with monkeypatch.context() as m:
                    m.setattr(torch.Tensor, "cpu", counting_cpu)
                    m.setattr(torch.Tensor, "item", counting_item)
                    opt.step()
                assert calls == {"cpu": 1, "item": 0}, (layers, calls)


def test_snapshot_only_on_recording_steps(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copies = []  # clones (the full statistics set) and copies into the lean set's reused buffers
    real_clone, real_foreach_copy = torch.Tensor.clone, torch._foreach_copy_

    def counting_clone(self, *a, **k):
        copies.append(("clone", tuple(self.shape)))
        return real_clone(self, *a, **k)

    def counting_foreach_copy(targets, sources, *a, **k):
        copies.extend(("copy", tuple(t.shape)) for t in sources)
        return real_foreach_copy(targets, sources, *a, **k)

    path = str(tmp_path / "run.h5")
    rec = upd.record(path, model, opt, every=None, stats_every=3)  # full set at step 0, lean set at step 3
    per_step = []
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
        copies.clear()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "clone", counting_clone)
            m.setattr(torch, "_foreach_copy_", counting_foreach_copy)
            opt.step()
        per_step.append(sorted(copies))
        assert all(track.pending is None for track in rec._tracks)  # nothing held between steps
    rec.close()
    shapes = sorted(tuple(p.shape) for p in model.parameters())
    # the parameters, before the step (and the full set's statistics copy tensors into their float64 buckets)
    assert [c for c in per_step[0] if c[0] == "clone"] == [("clone", s) for s in shapes]
    # the parameters and gradients before the step, the parameters after it: into buffers
    assert per_step[3] == sorted([("copy", s) for s in shapes] * 3)
    assert per_step[1:3] == per_step[4:] == [[], []]


def test_nonfinite_gradients_are_counted(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1):
        def poison(optimizer, args, kwargs):  # runs before the recorder's hook: registered first
            pass
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
            if step == 1:
                model.fc2.weight.grad[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            opt.step()
    with upd.open_run(path) as run:
        table = run.stats().set_index(["param", "step"])
        assert table.loc[("fc2.weight", 1), "grad_nonfinite"] == 3
        assert table.loc[("fc2.weight", 0), "grad_nonfinite"] == 0
        assert table.loc[("fc1.weight", 1), "grad_nonfinite"] == 0
        summary = upd.analyze(run).summary.set_index("param")
    assert summary.loc["fc2.weight", "first_nonfinite_step"] == 1


def test_nonfinite_parameters_are_counted_by_the_full_set(tmp_path):
    """The full set's parameter statistics are launched before the step with the gradients'; a NaN/Inf flag is
    recounted at read time from the parameter's snapshot before the step, and the update's from the update."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    g = torch.Generator().manual_seed(0)
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=1):
        for step in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
            if step == 1:
                with torch.no_grad():
                    model.fc2.weight[0, :2] = torch.tensor([float("nan"), float("inf")])
            opt.step()
    with upd.open_run(path) as run:
        table = run.stats().set_index(["param", "step"])
    assert table.loc[("fc2.weight", 1), "param_nonfinite"] == 2  # the values the step started from
    assert table.loc[("fc2.weight", 1), "update_nonfinite"] == 2  # nan - nan, inf - inf
    assert table.loc[("fc2.weight", 0), "param_nonfinite"] == 0
    assert table.loc[("fc1.weight", 1), "param_nonfinite"] == 0


def test_analyze_and_info_work_on_statistics_only_runs(tmp_path):
    from click.testing import CliRunner

    from upd.cli.main import main

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1):
        train_steps(model, opt, steps=6)
    result = CliRunner().invoke(main, ["analyze", path, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "fc1.weight" in result.output and (tmp_path / "a" / "update_to_data.png").exists()
    summary = pd.read_csv(tmp_path / "a" / "summary.csv").set_index("param")
    assert summary.loc["fc1.weight", "records"] == 6 and summary.loc["fc1.weight", "shape"] == "12x16"
    result = CliRunner().invoke(main, ["info", path])
    assert "0 full-tensor records (no steps), 6 statistics steps" in result.output
    assert CliRunner().invoke(main, ["verify", path]).exit_code == 3  # nothing to replay without tensors


def test_tensor_stats_edge_cases():
    t = torch.tensor([0.0, 0.0, 3.0, -4.0])
    mean, std, norm, absmax, zero_frac, nonfinite = stats_mod.tensor_stats(t).tolist()
    assert (mean, norm, absmax, zero_frac, nonfinite) == (-0.25, 5.0, 4.0, 0.5, 0.0)
    assert std == pytest.approx(t.std().item())
    one = stats_mod.tensor_stats(torch.tensor([2.0])).tolist()
    assert math.isnan(one[1]) and one[0] == 2.0
    assert log10_ratio(0.0, 1.0) == -math.inf and log10_ratio(1.0, 0.0) == math.inf
    assert math.isnan(log10_ratio(0.0, 0.0))


def test_large_tensors_use_the_one_pass_form_accurately():
    """Above TWO_PASS_LIMIT the std comes from the sum and the norm: still float32-accurate for weights."""
    torch.manual_seed(0)
    for t in (torch.randn(512, 1024) * 0.02, torch.randn(300_000) * 1e-3 + 1e-4):
        assert t.numel() > stats_mod.TWO_PASS_LIMIT
        mean, std, norm, absmax, zero_frac, flag = stats_mod.tensor_stats(t).tolist()
        ref = reference_stats(t)
        assert mean == pytest.approx(ref["mean"], rel=1e-4, abs=1e-6 * ref["absmax"])
        assert std == pytest.approx(ref["std"], rel=1e-5)
        assert norm == pytest.approx(ref["norm"], rel=1e-5)
        assert (absmax, zero_frac, flag) == (pytest.approx(ref["absmax"]), 0.0, 0.0)


def test_nonfinite_flag_then_exact_count():
    t = torch.randn(100_000)
    t[[3, 50, 70_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    row = stats_mod.tensor_stats(t)
    assert math.isnan(row[stats_mod.NONFINITE].item())  # flagged on the device, counted only when flagged
    host = torch.stack([row, stats_mod.tensor_stats(torch.ones(10))])
    stats_mod.count_nonfinite(host, [t, torch.ones(10)])
    assert host[:, stats_mod.NONFINITE].tolist() == [3.0, 0.0]


def test_batched_small_tensors_equal_one_by_one():
    torch.manual_seed(0)
    tensors = [torch.randn(5), torch.tensor(3.0), torch.zeros(4), torch.randn(100_000), torch.randn(7, 3),
               torch.tensor([1.0, 0.0, -2.0]), torch.ones(1, 1)]
    rows = stats_mod.stats_rows(tensors)
    for t, row in zip(tensors, rows):
        np.testing.assert_allclose(row.numpy(), stats_mod.tensor_stats(t).numpy(), rtol=1e-5, atol=1e-7,
                                   equal_nan=True)
    flagged = stats_mod.stats_rows([torch.tensor([1.0, float("inf")]), torch.ones(3)])
    assert math.isnan(flagged[0, stats_mod.NONFINITE].item()) and flagged[1, stats_mod.NONFINITE].item() == 0


def test_zero_fractions_only_where_asked(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 80), nn.ReLU(), nn.Linear(80, 4))  # an 80x80 weight: the large path
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=1):  # default: gradients only
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 80)).pow(2).mean().backward()
            opt.step()
    table = upd.open_run(path).stats()
    assert table["grad_zero_frac"].notna().all()
    for kind in ("param", "update", "state.exp_avg"):
        assert table[f"{kind}_zero_frac"].isna().all(), kind
    with pytest.raises(ValueError, match="zero_counts"):
        upd.record(str(tmp_path / "x.h5"), model, opt, zero_counts=("weights",), every=1)


def test_full_set_on_its_own_cadence(tmp_path):
    """Lean steps have no abs max, zero fraction or optimizer-state statistics; every full_stats_every-th step has."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=3):
        train_steps(model, opt, steps=7)
    table = upd.open_run(path).stats()
    full = table.groupby("step")["param_absmax"].apply(lambda s: s.notna().all())
    assert full[full].index.tolist() == [0, 3, 6]
    by_step = table.set_index("step")
    assert by_step.loc[[3, 6], "state.exp_avg_norm"].notna().all()  # Adam has no state before step 0
    assert by_step.loc[[1, 2, 4, 5], ["param_absmax", "grad_zero_frac", "state.exp_avg_norm"]].isna().all().all()
    assert table[LEAN_COLUMNS].notna().all().all()  # the lean set at every step, full steps included
    with pytest.raises(ValueError, match="full_stats_every"):
        upd.record(str(tmp_path / "x.h5"), model, opt, stats_every=1, full_stats_every=0, every=1)


def test_lean_set_counts_nonfinite_values_in_large_and_small_tensors(tmp_path):
    """A NaN/Inf in a large gradient (its own reductions) and in a small one (a bucket shared with other tensors):
    both counted exactly, and no other tensor of the bucket is spoiled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 80), nn.ReLU(), nn.Linear(80, 4))  # 6400 elements: above SMALL_LIMIT
    assert model[0].weight.numel() > stats_mod.SMALL_LIMIT >= model[2].weight.numel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=None):
        for step in range(2):
            opt.zero_grad()
            model(torch.randn(8, 80)).pow(2).mean().backward()
            if step == 1:
                model[0].weight.grad[0, :2] = float("nan")
                model[2].weight.grad[1, 5] = float("inf")
            opt.step()
    table = upd.open_run(path).stats().set_index(["param", "step"])
    assert table.loc[("0.weight", 1), "grad_nonfinite"] == 2 and table.loc[("2.weight", 1), "grad_nonfinite"] == 1
    assert table.loc[("0.weight", 1), "update_nonfinite"] == 2 and table.loc[("2.weight", 1), "update_nonfinite"] == 1
    for name in ("0.bias", "2.bias"):  # the same bucket as 2.weight, or none: untouched
        assert table.loc[(name, 1), ["grad_nonfinite", "update_nonfinite"]].tolist() == [0, 0]
        assert np.isfinite(table.loc[(name, 1), ["grad_std", "update_std", "update_to_data"]].astype(float)).all()
    assert (table.xs(0, level="step")["grad_nonfinite"] == 0).all()


def test_lean_set_keeps_the_std_of_a_scale_near_one():
    """|mean| >> std (a norm layer's scale, 1 +- 1e-4): float64 buckets keep the one-pass std exact; float32 sums
    would lose it (shown: the float32 one-pass form on the same tensor is off by far more)."""
    torch.manual_seed(0)
    scale = nn.Parameter(1 + 1e-4 * torch.randn(256))
    scale.grad = torch.randn(256)
    before = scale.detach().clone()
    pool = stats_mod.SnapshotPool()
    step = stats_mod.LeanStep(pool, ["scale"], [scale], [scale.detach()], [scale.grad])
    with torch.no_grad():
        scale -= 1e-6 * scale.grad
    got = step.read()["scale"]
    exact = before.double().std().item()
    assert got["param_std"] == pytest.approx(exact, rel=1e-6)
    assert got["update_std"] == pytest.approx((scale.detach().double() - before.double()).std().item(), rel=1e-6)
    n = 256
    one_pass_f32 = math.sqrt(max(0.0, (before.norm().item() ** 2 - before.sum().item() ** 2 / n) / (n - 1)))
    assert abs(one_pass_f32 - exact) > 100 * abs(got["param_std"] - exact)


@pytest.mark.parametrize("order", ["empty last", "empty first", "empty between"])
def test_lean_set_takes_an_empty_parameter_anywhere(order):
    """An empty parameter's lean statistics are NaN and its neighbours' exact, wherever it sits among the small
    tensors (the host adds each tensor's chunks up from its first one: the last one, empty, had none)."""
    torch.manual_seed(0)
    a, empty, b = (nn.Parameter(torch.randn(n)) for n in (70, 0, 5))
    params = {"empty last": [a, b, empty], "empty first": [empty, a, b], "empty between": [a, empty, b]}[order]
    for p in params:
        p.grad = torch.randn_like(p)
    befores = [p.detach().clone() for p in params]
    step = stats_mod.LeanStep(stats_mod.SnapshotPool(), [str(i) for i in range(3)], params, params,
                              [p.grad for p in params])
    with torch.no_grad():
        for p in params:
            p -= 0.1 * p.grad
    rows = step.read()
    for i, (p, before) in enumerate(zip(params, befores)):
        got = rows[str(i)]
        if p.numel() == 0:
            assert np.isnan([got["param_mean"], got["grad_std"], got["update_norm"]]).all()
            continue
        assert got["param_std"] == pytest.approx(before.double().std().item(), rel=1e-6)
        assert got["update_norm"] == pytest.approx((p.detach() - before).double().norm().item(), rel=1e-6)
