"""upd advise on real runs trained with deliberately wrong per-layer learning rates (AdamW and SGD with momentum):
the multipliers it returns undo the applied factors within 2x, and re-training with its param groups brings every
weight's median update:data within +-0.3 of the target; the inverted advice does not (the check can fail)."""
import json
import math

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd.analyzer.advise import advise, optimizer_kind, parse_steps
from upd.cli.main import main

TARGET = -3.0
STEPS = 30
WIDTH = 32
HIGH, LOW = "2.weight", "4.weight"  # trained with 30x too high / 30x too low a learning rate
FACTOR = 30.0
# The base lrs put the untouched weights near the target to begin with (a short horizon: few steps, small moves).
OPTIMIZERS = {"adamw": (lambda groups: torch.optim.AdamW(groups, weight_decay=0.01), 2e-4),
              "sgd": (lambda groups: torch.optim.SGD(groups, momentum=0.9), 3e-3)}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def train(path, kind: str, lrs: dict) -> None:
    """STEPS recorded steps (statistics every step), one param group per parameter with lrs[name] (default: the
    optimizer's base lr)."""
    make, base = OPTIMIZERS[kind]
    net = model()
    opt = make([{"params": [p], "lr": lrs.get(n, base)} for n, p in net.named_parameters()])
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=gen)
    with upd.record(path, net, opt, every=None, stats_every=1, overwrite=True):
        for _ in range(STEPS):
            x = torch.randn(64, 16, generator=gen)
            loss = nn.functional.mse_loss(net(x), torch.tanh(x @ teacher))
            opt.zero_grad()
            loss.backward()
            opt.step()


def weight_medians(path) -> dict:
    with upd.open_run(path) as run:
        summary = upd.analyze(run).summary
    return {r.param: r.median_update_to_data for r in summary.itertuples() if r.status in ("ok", "HIGH", "LOW")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_advice_undoes_wrong_per_layer_lrs_and_retraining_hits_the_target(tmp_path, kind):
    base = OPTIMIZERS[kind][1]
    wrong = {HIGH: base * FACTOR, LOW: base / FACTOR}
    train(tmp_path / "wrong.h5", kind, wrong)
    advice = advise(tmp_path / "wrong.h5", target=TARGET)
    m = dict(zip(advice.per_param["param"], advice.per_param["multiplier"]))
    others = [n for n in m if n not in (HIGH, LOW)]
    reference = math.exp(sum(math.log(m[n]) for n in others) / len(others))  # what the untouched layers need
    # The truth: the applied factor undone, relative to what the untouched layers need.
    assert 1 / 2 < m[HIGH] / reference * FACTOR < 2, (m, reference)
    assert 1 / 2 < m[LOW] / reference / FACTOR < 2, (m, reference)

    advised = dict(wrong)
    advised.update({r.param: r.advised_lr for r in advice.per_param.itertuples()})
    train(tmp_path / "advised.h5", kind, advised)
    medians = weight_medians(tmp_path / "advised.h5")
    assert set(medians) == set(m)
    assert all(abs(v - TARGET) <= 0.3 for v in medians.values()), medians

    # The same check fails on the inverted advice (1/m): it is not a check that always passes.
    inverted = dict(wrong)
    inverted.update({r.param: r.lr / r.multiplier for r in advice.per_param.itertuples()})
    train(tmp_path / "inverted.h5", kind, inverted)
    assert not all(abs(v - TARGET) <= 0.3 for v in weight_medians(tmp_path / "inverted.h5").values())


@pytest.fixture(scope="module")
def wrong_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("advise") / "wrong.h5"
    train(path, "adamw", {HIGH: OPTIMIZERS["adamw"][1] * FACTOR})
    return path


def test_cli_table_snippet_json_and_steps(wrong_run):
    runner = CliRunner()
    out = runner.invoke(main, ["advise", str(wrong_run), "--steps", "10:"])
    assert out.exit_code == 0, out.output
    assert "over steps 10..29" in out.output and "short horizon" in out.output
    snippet = out.output[out.output.index("params = dict"):out.output.index("]\n") + 1]
    assert "optimizer = torch.optim.AdamW(param_groups, ...)" in out.output
    net = model()
    params = dict(net.named_parameters())
    groups = eval(snippet.split("\n", 1)[1].split("=", 1)[1])  # the snippet is valid Python for a real optimizer
    torch.optim.AdamW(groups)
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in params.values()}
    data = json.loads(runner.invoke(main, ["advise", str(wrong_run), "--json", "--target", "-2.5"]).output)
    assert data["target"] == -2.5 and data["optimizers"]["0"]["proportional"] is True
    row = next(r for r in data["per_param"] if r["param"] == HIGH)
    assert math.isclose(row["multiplier"], 10 ** (-2.5 - row["measured"]))
    for bad in (["--steps", "5"], ["--steps", "a:b"], ["--steps", "9:3"], ["--target", "nan"]):
        result = runner.invoke(main, ["advise", str(wrong_run), *bad])
        assert result.exit_code == 2 and result.output.count("\n") == 1, (bad, result.output)


def test_not_proportional_optimizers_say_so_instead_of_a_number():
    for name in ("torch.optim.Adafactor", "torch.optim.LBFGS", "torch.optim.Rprop", "mylib.Shampoo"):
        proportional, why = optimizer_kind(name)
        assert not proportional and why
    assert optimizer_kind("torch.optim.AdamW")[0] and optimizer_kind("torch.optim.SGD")[0]
    assert parse_steps("3:") == (3, None) and parse_steps(":7") == (None, 7)


def test_lbfgs_run_gets_no_multiplier(tmp_path):
    net = model()
    opt = torch.optim.LBFGS(net.parameters(), lr=0.1, max_iter=2)
    x = torch.randn(32, 16)
    with upd.record(tmp_path / "lbfgs.h5", net, opt, every=None, stats_every=1):
        for _ in range(3):
            def closure():
                opt.zero_grad()
                loss = net(x).pow(2).mean()
                loss.backward()
                return loss
            opt.step(closure)
    advice = advise(tmp_path / "lbfgs.h5")
    assert advice.per_param["multiplier"].isna().all() and advice.per_param["note"].str.contains("line search").all()
    assert "line search" in CliRunner().invoke(main, ["advise", str(tmp_path / "lbfgs.h5")]).output


def test_a_run_with_no_weight_says_so_in_one_line(tmp_path):
    """A run whose parameters are all vectors (a norm layer alone, ndim < 2): nothing to advise, said in one line,
    never a raw empty table."""
    net = nn.LayerNorm(8)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with upd.record(tmp_path / "vectors.h5", net, opt, every=None, stats_every=1):
        for _ in range(3):
            net(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    result = CliRunner().invoke(main, ["advise", str(tmp_path / "vectors.h5")])
    assert result.exit_code == 0, result.output
    assert "DataFrame" not in result.output and "Columns" not in result.output, result.output
    assert result.output.strip().splitlines() == [
        "no weight (ndim >= 2) in the run: nothing to advise (biases and norm scales are not judged)"]
