"""Findings on real training runs: an injected lr spike is found at its step with its weights, and the same run
without it has no such finding; three healthy runs (the demo's good run, a tiny GPT, a small CNN) have no finding
at all; a dead ReLU layer, a frozen-in-practice layer and a run clipped on every step each get their finding; the
offline findings and the live rules agree step by step; findings come first in `upd analyze`, --json and HTML."""
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd import alert_rules
from upd.analyzer.findings import CLIPPING
from upd.cli.main import main
from upd.demo import makemore

SPIKE_STEP, SPIKE = 25, 100.0


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def train_mlp(path, *, steps=50, lr=3e-4, spike_at=None, clip=None, groups=None, full_stats_every=10):
    """AdamW on a regression task, statistics every step, the loss logged; spike_at: that step's lr x SPIKE."""
    net = mlp()
    opt = torch.optim.AdamW(groups(net) if groups else net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=gen)
    with upd.record(path, net, opt, every=None, stats_every=1, full_stats_every=full_stats_every,
                    overwrite=True) as rec:
        for step in range(steps):
            x = torch.randn(64, 16, generator=gen)
            loss = nn.functional.mse_loss(net(x), torch.tanh(x @ teacher))
            opt.zero_grad()
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(net.parameters(), clip)
            rec.log(loss=loss)
            base = [g["lr"] for g in opt.param_groups]
            if step == spike_at:
                for g in opt.param_groups:
                    g["lr"] *= SPIKE
            opt.step()
            for g, lr_ in zip(opt.param_groups, base):
                g["lr"] = lr_
    return net


def findings_of(path):
    return upd.analyze(path).findings


def kinds(findings):
    return {f.kind for f in findings}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("findings")
    train_mlp(folder / "spike.h5", spike_at=SPIKE_STEP)
    train_mlp(folder / "plain.h5")
    return folder


def test_lr_spike_is_found_at_its_step_with_its_weights(runs):
    found = [f for f in findings_of(runs / "spike.h5") if f.kind == alert_rules.UPDATE_SPIKE]
    assert [f.step for f in found] == [SPIKE_STEP], [f.text for f in found]
    assert set(found[0].params) == {"0.weight", "2.weight", "4.weight"}
    assert f"step {SPIKE_STEP}" in found[0].text and "x its running median" in found[0].text
    assert found[0].evidence["loss"] is not None  # the loss was logged: the finding says what it did
    assert all(w["factor"] > 10 for w in found[0].evidence["weights"])
    assert "the lr was 100x its recent median there" in found[0].text  # the cause, where the lr shows it


def test_the_same_run_without_the_spike_has_no_finding(runs):
    analysis = upd.analyze(runs / "plain.h5")
    assert analysis.findings == [], [f.text for f in analysis.findings]
    assert analysis.findings_text().startswith("findings: healthy: no finding over 50 steps")


def test_offline_findings_and_live_rules_agree_step_by_step(runs):
    """check_step, fed one step's host values at a time (as a live checker is), fires the spike rule at exactly
    the steps and weights the offline finding names."""
    with upd.open_run(runs / "spike.h5") as run:
        stats = run.stats()
        weights = {r.param for r in run.params().itertuples() if len(r.shape) >= 2}
    history = alert_rules.NormHistory()
    live = []
    for step, rows in stats.sort_values("step").groupby("step"):
        values = {r["param"]: r.to_dict() for _, r in rows.iterrows()}
        live += [a for a in alert_rules.check_step(int(step), values, history, weights)
                 if a.kind == alert_rules.UPDATE_SPIKE and a.param in weights]
    offline = [f for f in findings_of(runs / "spike.h5") if f.kind == alert_rules.UPDATE_SPIKE]
    assert {(a.step, a.param) for a in live} == {(f.step, p) for f in offline for p in f.params}
    assert live and all(a.step == SPIKE_STEP for a in live)


@pytest.mark.slow
def test_no_false_alarm_on_three_healthy_real_runs(tmp_path):
    makemore.train(tmp_path / "demo.h5", steps=300, every=10, log=None)  # the demo's good run, every 10th step
    healthy = {"demo": tmp_path / "demo.h5"}

    torch.manual_seed(0)  # a tiny GPT: embedding, two causal transformer blocks, a head; AdamW
    vocab, ctx = 32, 16
    emb, pos = nn.Embedding(vocab, 32), nn.Embedding(ctx, 32)
    blocks = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                                              norm_first=True), 2, enable_nested_tensor=False)
    gpt = nn.ModuleDict({"emb": emb, "pos": pos, "blocks": blocks, "head": nn.Linear(32, vocab)})
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-4)
    mask = nn.Transformer.generate_square_subsequent_mask(ctx)
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, vocab, (4096,), generator=gen) % 7 + (torch.arange(4096) % 5)  # some structure
    with upd.record(tmp_path / "gpt.h5", gpt, opt, every=None, stats_every=1) as rec:
        for _ in range(40):
            at = torch.randint(0, len(text) - ctx - 1, (16,), generator=gen)
            x = torch.stack([text[i:i + ctx] for i in at])
            y = torch.stack([text[i + 1:i + ctx + 1] for i in at])
            h = gpt["blocks"](gpt["emb"](x) + gpt["pos"](torch.arange(ctx)), mask=mask, is_causal=True)
            loss = nn.functional.cross_entropy(gpt["head"](h).reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            rec.log(loss=loss)
            opt.step()
    healthy["gpt"] = tmp_path / "gpt.h5"

    torch.manual_seed(0)  # a small CNN on random images with a learnable rule; SGD with momentum
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    opt = torch.optim.SGD(cnn.parameters(), lr=0.02, momentum=0.9)
    with upd.record(tmp_path / "cnn.h5", cnn, opt, every=None, stats_every=1) as rec:
        for _ in range(40):
            x = torch.randn(32, 3, 12, 12, generator=gen)
            y = (x.mean((2, 3)).argmax(1) + (x[:, 0, 0, 0] > 0)) % 4
            loss = nn.functional.cross_entropy(cnn(x), y)
            opt.zero_grad()
            loss.backward()
            rec.log(loss=loss)
            opt.step()
    healthy["cnn"] = tmp_path / "cnn.h5"
    for name, path in healthy.items():
        analysis = upd.analyze(path)
        assert analysis.findings == [], (name, [f.text for f in analysis.findings])
        assert analysis.findings_text().startswith("findings: healthy"), name


@pytest.mark.slow
def test_dead_relu_layer_is_found(tmp_path):
    def dead(net):
        with torch.no_grad():
            net[2].bias.fill_(-100.0)  # every input of the second ReLU negative: nothing flows through it
        return net.parameters()
    train_mlp(tmp_path / "dead.h5", steps=20, groups=dead)
    found = {f.params[0]: f for f in findings_of(tmp_path / "dead.h5") if f.kind == alert_rules.NOT_MOVING}
    assert found["2.weight"].evidence["verdict"] == "dead" and found["2.weight"].step == 0
    assert found["4.weight"].evidence["verdict"] == "dead"  # its inputs are the dead ReLU's zeros
    assert "dead since step 0" in found["2.weight"].text and "gradient zero" in found["2.weight"].text
    assert found["0.weight"].evidence["verdict"] == "dead"  # and no gradient flows back through it to layer 0
    assert "4.bias" not in found  # the output bias still learns: not everything is called dead
    assert all(f.kind != alert_rules.UPDATE_SPIKE for f in findings_of(tmp_path / "dead.h5"))


@pytest.mark.slow
def test_frozen_in_practice_layer_is_found(tmp_path):
    def lr_zero_for_middle(net):
        return [{"params": [net[2].weight], "lr": 0.0},
                {"params": [p for n, p in net.named_parameters() if n != "2.weight"]}]
    train_mlp(tmp_path / "frozen.h5", steps=20, groups=lr_zero_for_middle)
    found = [f for f in findings_of(tmp_path / "frozen.h5") if f.kind == alert_rules.NOT_MOVING]
    assert [(f.params, f.evidence["verdict"], f.step) for f in found] == [(["2.weight"], "frozen", 0)]
    assert "update exactly zero on 20/20 steps" in found[0].text


@pytest.mark.slow
def test_clipped_on_every_step_is_found(tmp_path):
    train_mlp(tmp_path / "clipped.h5", steps=12, clip=1e-3, lr=3e-2)
    found = [f for f in findings_of(tmp_path / "clipped.h5") if f.kind == CLIPPING]
    assert len(found) == 1 and found[0].text.startswith(
        "gradient clipped to 0.001 on 12/12 steps (pre-clip total norm median ")
    assert found[0].evidence["clipped_to"] == pytest.approx(1e-3, rel=1e-3)
    train_mlp(tmp_path / "unclipped.h5", steps=12, clip=1e6)
    assert CLIPPING not in kinds(findings_of(tmp_path / "unclipped.h5"))


def test_findings_first_in_terminal_json_and_html(runs, tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["analyze", str(runs / "spike.h5"), "--no-plots", "--html", str(tmp_path / "r.html")])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("findings (1, most severe first):\n  1. update-norm spike at step 25")
    page = (tmp_path / "r.html").read_text()
    assert page.index("<h2>Findings</h2>") < page.index("<h2>Summary</h2>") and "update-norm spike at step 25" in page
    result = runner.invoke(main, ["analyze", str(runs / "spike.h5"), "--no-plots", "--json"])
    data = json.loads(result.stdout)
    assert [f["step"] for f in data["findings"]] == [SPIKE_STEP]
    assert {"summary", "metrics", "notes", "findings_text"} <= set(data)
    row = next(r for r in data["metrics"] if r["param"] == "0.weight" and r["step"] == 3)
    assert np.isfinite(row["rms_update_to_data"])


def train_adam_state(path, *, loss_scale=1.0, reset_second_moment_at=None, steps=20):
    """Adam with the full statistics set (state included) at every step; optionally a loss scaled far down (the
    gradients then sit below eps) or the second moment wiped at one step (a checkpoint load that lost it)."""
    net = mlp()
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    with upd.record(path, net, opt, every=None, stats_every=1, full_stats_every=1, overwrite=True):
        for step in range(steps):
            x = torch.randn(64, 16, generator=gen)
            loss = loss_scale * net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == reset_second_moment_at:
                for state in opt.state.values():
                    state["exp_avg_sq"].zero_()
            opt.step()


@pytest.mark.slow
def test_adam_state_anomalies_are_found_and_a_normal_state_is_not(tmp_path):
    train_adam_state(tmp_path / "tiny.h5", loss_scale=1e-14)
    found = [f for f in findings_of(tmp_path / "tiny.h5") if f.kind == alert_rules.SECOND_MOMENT_COLLAPSE]
    assert {p for f in found for p in f.params} >= {"0.weight", "2.weight", "4.weight"}
    assert all("eps, not the gradient" in f.text and f.evidence["value"] < 1e-8 for f in found)

    train_adam_state(tmp_path / "wiped.h5", reset_second_moment_at=10)
    found = [f for f in findings_of(tmp_path / "wiped.h5") if f.kind == alert_rules.EXP_AVG_RATIO]
    assert found and all(f.step == 10 for f in found), [f.text for f in found]
    assert all(f.evidence["value"] > 10 for f in found)

    train_adam_state(tmp_path / "normal.h5")
    state_kinds = {alert_rules.SECOND_MOMENT_COLLAPSE, alert_rules.EXP_AVG_RATIO}
    assert not state_kinds & kinds(findings_of(tmp_path / "normal.h5"))


def test_rules_take_one_step_or_whole_columns_alike():
    rules = alert_rules.AlertRules()
    column = {"update_to_data": np.array([-3.0, -1.0, -5.0, np.nan, -np.inf]),
              "update_norm": np.array([1.0, 1.0, 1.0, 0.0, 0.0]), "grad_norm": np.array([1.0, 1.0, 1.0, 0.0, 1.0])}
    whole = alert_rules.out_of_band(column, rules), alert_rules.not_moving(column, rules)
    for i in range(5):
        one = {k: float(v[i]) for k, v in column.items()}
        assert int(alert_rules.out_of_band(one, rules)) == whole[0][i]
        assert int(alert_rules.not_moving(one, rules)) == whole[1][i]
    assert list(whole[0]) == [0, 1, -1, 0, 0]
    assert list(whole[1]) == [0, 0, 0, alert_rules.GRAD_ZERO, alert_rules.UPDATE_ZERO]
    norms = np.r_[np.ones(8), 50.0, np.ones(3)]
    history = alert_rules.NormHistory(rules)
    live = []
    for n in norms:
        live.append(float(alert_rules.update_spike({"update_norm": n}, history.baseline("w"), rules)))
        history.add("w", n)
    offline = alert_rules.update_spike({"update_norm": norms}, alert_rules.spike_baselines(norms, rules), rules)
    assert live == list(offline) and np.flatnonzero(offline).tolist() == [8]
    with pytest.raises(ValueError):
        alert_rules.AlertRules(low=-1, high=-2)


def test_spike_baselines_equal_the_live_history_on_ragged_columns():
    """The offline sliding-window baselines equal NormHistory's step by step, with zeros, NaN and short columns."""
    rng = np.random.default_rng(0)
    rules = alert_rules.AlertRules()
    for n in (0, 3, 5, 6, 30, 300):
        norms = rng.lognormal(size=n)
        norms[rng.random(n) < 0.2] = 0.0
        norms[rng.random(n) < 0.05] = np.nan
        history, live = alert_rules.NormHistory(rules), []
        for value in norms:
            live.append(history.baseline("w"))
            history.add("w", value)
        np.testing.assert_array_equal(np.array(live, float), alert_rules.spike_baselines(norms, rules))


@pytest.mark.slow
def test_nan_gradient_is_found_first_with_its_step(tmp_path):
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    with upd.record(tmp_path / "nan.h5", net, opt, every=None, stats_every=1):
        for step in range(10):
            opt.zero_grad()
            net(torch.randn(8, 16)).pow(2).mean().backward()
            if step == 6:
                net[2].weight.grad[0, 0] = float("nan")
            opt.step()
    found = findings_of(tmp_path / "nan.h5")
    assert found[0].kind == alert_rules.NONFINITE, [f.text for f in found]
    first = {f.params[0]: f.step for f in found if f.kind == alert_rules.NONFINITE}
    assert first["2.weight"] == 6 and min(first.values()) == 6  # the others follow once NaN spreads
    assert "NaN/Inf on" in found[0].text
