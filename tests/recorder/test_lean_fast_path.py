"""The lean statistics at every step on models with both small (bucketed) and large tensors: against a direct
reference, the total gradient norms they share with the clipping check, and a layout that changes mid-run."""
import math

import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.recorder import device_stats as stats_mod
from upd.runfile import schema

LEAN_COLUMNS = list(stats_mod.LEAN_COLUMNS)


def model_with_large_and_small_tensors(seed=0):
    """Two weights above SMALL_LIMIT (their own reductions), a LayerNorm (scale near 1), biases (buckets)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 200), nn.LayerNorm(200), nn.GELU(), nn.Linear(200, 30), nn.Linear(30, 5))
    sizes = sorted(p.numel() for p in model.parameters())
    assert sizes[-2] > stats_mod.SMALL_LIMIT >= sizes[-3]
    return model


def batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 24, generator=g), 3 * torch.randn(16, 5, generator=g)) for _ in range(steps)]


def reference(t: torch.Tensor) -> dict:
    x = t.detach().double().flatten()
    return {"mean": x.mean().item(), "std": x.std().item(), "norm": x.norm().item(),
            "nonfinite": float((~torch.isfinite(x)).sum())}


def close(got: float, ref: float, scale: float) -> bool:
    """float32 precision relative to the tensor's own scale, as tests/recorder/test_stats.py allows."""
    return math.isclose(got, ref, rel_tol=2e-6, abs_tol=1e-6 * scale + 1e-12)


def test_lean_statistics_of_large_and_small_tensors_match_a_reference(tmp_path):
    model = model_with_large_and_small_tensors()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected = {}
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=None):
        for step, (x, y) in enumerate(batches(4)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
            opt.step()
            for n, p in model.named_parameters():
                b, g = before[n]
                for kind, t in (("param", b), ("grad", g), ("update", p.detach() - b)):
                    scale = t.detach().double().abs().max().item()
                    for stat, value in reference(t).items():
                        expected[(n, step, f"{kind}_{stat}")] = (value, scale)
    table = upd.open_run(path).stats().set_index(["param", "step"])
    assert set(LEAN_COLUMNS) <= set(table.columns) and len(table) == 4 * 8
    wrong = []
    for (name, step, column), (ref, scale) in expected.items():
        if not close(table.loc[(name, step), column], ref, scale):
            wrong.append((name, step, column, table.loc[(name, step), column], ref))
    assert not wrong
    row = table.loc[("0.weight", 3)]
    assert row["update_to_data"] == pytest.approx(math.log10(row["update_std"] / row["param_std"]))
    assert row["grad_to_data"] == pytest.approx(math.log10(row["grad_std"] / row["param_std"]))
    # The comparison can fail: the update's std taken one step off (a snapshot missed) is far outside it.
    ref, scale = expected[("0.weight", 2, "update_std")]
    assert not close(table.loc[("0.weight", 3), "update_std"], ref, scale)


def clipped_run(path, max_norm, include=None, steps=6):
    """A loop with clip_grad_norm_, recorded (statistics only) unless path is None; returns what clip_grad_norm_
    returned per step (the total norm before clipping, of every gradient)."""
    model = model_with_large_and_small_tensors()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    returned = []
    rec = None if path is None else upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=None,
                                                include=include)
    for x, y in batches(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        returned.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    if rec is not None:
        rec.close()
    return returned


@pytest.mark.slow
def test_step_norm_is_the_statistics_own_and_clipping_shows(tmp_path):
    path = str(tmp_path / "run.h5")
    unclipped = clipped_run(None, max_norm=1e9)
    max_norm = float(np.median(unclipped))  # about half the steps clipped
    returned = clipped_run(path, max_norm)
    with upd.open_run(path) as run:
        scalars = run.scalars().sort_values("step")
        stats = run.stats()
    backward = scalars[schema.SCALAR_GRAD_NORM_BACKWARD].tolist()
    at_step = scalars[schema.SCALAR_GRAD_NORM_AT_STEP].tolist()
    assert backward == pytest.approx(returned, rel=1e-5)  # before clipping: what clip_grad_norm_ measured
    clipped = [norm > max_norm * 1.001 for norm in returned]
    assert 0 < sum(clipped) < len(returned)
    assert at_step == pytest.approx([min(norm, max_norm) for norm in returned], rel=1e-5)
    # clipped steps: the step saw less than the backward pass left (the check that tells them apart can fail)
    assert [s < b * (1 - 1e-4) for s, b in zip(at_step, backward)] == clipped
    # the step's norm is the norm of the per-gradient norms in the statistics table, taken once
    per_step = stats.groupby("step")["grad_norm"].apply(lambda n: math.sqrt((n.astype(float) ** 2).sum()))
    assert per_step.tolist() == pytest.approx(at_step, rel=1e-6)


def test_step_norm_counts_the_gradients_include_leaves_out(tmp_path):
    path = str(tmp_path / "run.h5")
    returned = clipped_run(path, max_norm=1e9, include="*.weight", steps=3)
    with upd.open_run(path) as run:
        scalars = run.scalars().sort_values("step")
        stats = run.stats()
    assert set(stats["param"]) == {"0.weight", "1.weight", "3.weight", "4.weight"}
    assert scalars[schema.SCALAR_GRAD_NORM_AT_STEP].tolist() == pytest.approx(returned, rel=1e-5)
    weights_only = stats.groupby("step")["grad_norm"].apply(lambda n: math.sqrt((n.astype(float) ** 2).sum()))
    assert all(w < r * (1 - 1e-6) for w, r in zip(weights_only, returned))  # the biases count too


def test_a_changing_layout_is_followed(tmp_path):
    """A parameter without a gradient at one step, and a param group added mid-run: rows where gradients are, each
    parameter's statistics its own."""
    model = model_with_large_and_small_tensors()
    extra = nn.Parameter(torch.randn(5000) * 0.1)  # a large tensor
    head = model[4]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")
    grads = {}
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=None):
        for step, (x, y) in enumerate(batches(6)):
            if step == 3:
                opt.add_param_group({"params": [extra]})
            opt.zero_grad(set_to_none=True)
            head.weight.requires_grad_(step != 1)  # no gradient at step 1
            loss = nn.functional.mse_loss(model(x), y) + (extra.pow(2).mean() if step >= 3 else 0)
            loss.backward()
            grads[step] = {n: p.grad.norm().item() for n, p in [*model.named_parameters(), ("extra", extra)]
                           if p.grad is not None}
            opt.step()
    table = upd.open_run(path).stats()
    names = sorted(set(table["param"]))
    extra_name = [n for n in names if n not in dict(model.named_parameters())]
    assert len(extra_name) == 1
    for step, norms in grads.items():
        rows = table[table["step"] == step].set_index("param")
        rename = {"extra": extra_name[0]}
        assert sorted(rows.index) == sorted(rename.get(n, n) for n in norms)
        for n, norm in norms.items():
            assert rows.loc[rename.get(n, n), "grad_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("make_optimizer, clip", [
    (lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), True),  # Lightning's automatic optimization
    (lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=3), False),  # several closure calls per step
], ids=["adamw-clipped-in-closure", "lbfgs"])
def test_a_closure_step_gets_the_lean_set_from_the_gradients_the_closure_left(tmp_path, make_optimizer, clip):
    """step(closure): the gradient exists only inside the step. The lean set copies the parameters before it and
    reduces the gradients the last closure call left after it; a parameter the closure gives no gradient has NaN
    gradient statistics and a zero update. Against a direct reference, and the step's total norm against the clipped
    gradients."""
    model = model_with_large_and_small_tensors()
    frozen_out = nn.Parameter(torch.ones(3))  # in the optimizer, never in the loss: no gradient
    opt = make_optimizer(list(model.parameters()) + [frozen_out])
    expected, norms_seen = {}, []
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, stats_every=1, full_stats_every=None) as rec:
        for step, (x, y) in enumerate(batches(4)):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}

            def closure():
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                if clip:
                    norms_seen.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
                return loss
            opt.step(closure)
            for n, p in model.named_parameters():
                for kind, t in (("param", before[n]), ("grad", p.grad), ("update", p.detach() - before[n])):
                    scale = t.detach().double().abs().max().item()
                    for stat, value in reference(t).items():
                        expected[(n, step, f"{kind}_{stat}")] = (value, scale)
        assert isinstance(rec._tracks[0].stats_pool, stats_mod.SnapshotPool)  # the lean path took the steps
    with upd.open_run(path) as run:
        table = run.stats().set_index(["param", "step"])
        scalars = run.scalars().sort_values("step")
    wrong = [(name, step, column, table.loc[(name, step), column], ref)
             for (name, step, column), (ref, scale) in expected.items()
             if not close(table.loc[(name, step), column], ref, scale)]
    assert not wrong
    outside_the_model = set(table.index.get_level_values("param")) - set(dict(model.named_parameters()))
    assert len(outside_the_model) == 1
    unused = table.xs(outside_the_model.pop(), level="param")
    assert len(unused) == 4 and unused["grad_norm"].isna().all() and unused["grad_to_data"].isna().all()
    assert (unused["update_norm"] == 0).all() and (unused["param_norm"] > 0).all()
    # The comparison can fail: the gradient of the step before (what a copy before the closure would hold).
    ref, scale = expected[("0.weight", 2, "grad_std")]
    assert not close(table.loc[("0.weight", 3), "grad_std"], ref, scale)
    if clip:  # clipped inside the closure: the backward pass left the unclipped norm, the step saw at most 0.5
        assert scalars[schema.SCALAR_GRAD_NORM_BACKWARD].tolist() == pytest.approx(norms_seen, rel=1e-5)
        assert scalars[schema.SCALAR_GRAD_NORM_AT_STEP].max() <= 0.5 * (1 + 1e-5)
