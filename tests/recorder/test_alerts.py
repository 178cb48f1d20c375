"""Early warnings, live (upd.record(..., alerts=True)), on real training runs: an lr spike injected at step k fires
update-norm spike alerts at step k naming the weights, warned about (upd.TrainingAlert), stored in run.events(),
handed to a user sink and counted there as alerts/<kind>, and among `upd analyze`'s findings; the same run without
the spike has no event; a NaN fires a nonfinite alert; the warnings are rate-limited; the flight recorder dumps on
an alert; the live checker is bit-identical to alert_rules.check_step; a hostile events table is refused."""
import json
import warnings

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd import alert_rules
from upd.alert_rules import AlertRules
from upd.cli.main import main
from upd.recorder.alerts import MAX_WARNINGS, LiveAlerts
from upd.recorder.recorder import TrainingAlert
from upd.runfile import schema

SPIKE_STEP, SPIKE, STEPS = 25, 100.0, 40
WEIGHTS = {"0.weight", "2.weight", "4.weight"}


class Collect:
    """A user sink keeping every SinkStep."""

    def __init__(self):
        self.steps = []

    def write(self, steps):
        self.steps.extend(steps)

    def close(self):
        pass


def train(path, *, steps=STEPS, spike_at=None, nan_at=None, alerts=True, lr=3e-4, **options):
    """AdamW on a small regression MLP (tests/analyzer/test_findings.py's), statistics every step; spike_at: that
    step's lr x SPIKE; nan_at: that step's first-layer gradient made NaN. Returns the warnings raised."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, net, opt, every=None, alerts=alerts, overwrite=True, **options) as rec:
            for step in range(steps):
                x = torch.randn(64, 16, generator=gen)
                loss = nn.functional.mse_loss(net(x), torch.tanh(x @ teacher))
                opt.zero_grad()
                loss.backward()
                if step == nan_at:
                    net[0].weight.grad[0, 0] = float("nan")
                rec.log(loss=loss)
                base = [g["lr"] for g in opt.param_groups]
                if step == spike_at:
                    for g in opt.param_groups:
                        g["lr"] *= SPIKE
                opt.step()
                for g, lr_ in zip(opt.param_groups, base):
                    g["lr"] = lr_
    return [w for w in caught if issubclass(w.category, upd.RecorderWarning)], rec


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    path = tmp_path_factory.mktemp("alerts") / "spike.h5"
    sink = Collect()
    caught, rec = train(path, spike_at=SPIKE_STEP, sinks=[sink])
    return path, sink, caught


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_an_lr_spike_alerts_at_its_step_naming_the_weights(spiked):
    path, sink, caught = spiked
    with upd.open_run(path) as run:
        events = run.events()
    spikes = events[events["kind"] == alert_rules.UPDATE_SPIKE]
    assert set(spikes["step"]) == {SPIKE_STEP}  # within 1 step of the spike: at it
    assert WEIGHTS <= set(spikes["param"])
    assert (spikes["value"] > 10).all()
    alerts = [w for w in caught if issubclass(w.category, TrainingAlert)]
    spike_warnings = [str(w.message) for w in alerts if "update_spike" in str(w.message)]
    assert len(spike_warnings) == 1 and f"step {SPIKE_STEP}" in spike_warnings[0]
    assert all(name in spike_warnings[0] for name in ("0.weight", "2.weight"))


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_the_sink_gets_the_alerts_with_their_step(spiked):
    _, sink, _ = spiked
    at = [s for s in sink.steps if s.step == SPIKE_STEP and s.params]
    assert len(at) == 1
    assert WEIGHTS <= {a.param for a in at[0].alerts if a.kind == alert_rules.UPDATE_SPIKE}
    tags = upd.sinks.base.metrics(at[0])
    assert tags[f"alerts/{alert_rules.UPDATE_SPIKE}"] >= 3
    quiet = [s for s in sink.steps if s.params and s.step != SPIKE_STEP]
    assert quiet and all(upd.sinks.base.metrics(s)[f"alerts/{alert_rules.UPDATE_SPIKE}"] == 0 for s in quiet)


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_analyze_and_info_show_the_recorded_events(spiked):
    path, _, _ = spiked
    analysis = upd.analyze(path)
    recorded = [f for f in analysis.findings if f.kind == "recorded_alerts"
                and f.evidence["alert_kind"] == alert_rules.UPDATE_SPIKE]
    assert len(recorded) == 1 and recorded[0].step == SPIKE_STEP and WEIGHTS <= set(recorded[0].params)
    assert f"first at step {SPIKE_STEP}" in recorded[0].text and "update_spike" in recorded[0].text
    assert recorded[0].text in analysis.findings_text()
    json.dumps(recorded[0].to_dict())  # plain JSON, as analyze --json prints it
    out = CliRunner().invoke(main, ["info", str(path)])
    assert out.exit_code == 0, out.output
    assert "events:" in out.output and "update_spike" in out.output and f"step {SPIKE_STEP}" in out.output
    as_json = json.loads(CliRunner().invoke(main, ["info", "--json", str(path)]).output)
    assert any(e["kind"] == alert_rules.UPDATE_SPIKE for e in as_json["events"])


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_the_same_run_without_the_spike_has_no_event(tmp_path):
    caught, _ = train(tmp_path / "plain.h5")
    with upd.open_run(tmp_path / "plain.h5") as run:
        events = run.events()
    assert len(events) == 0, events
    assert not [w for w in caught if issubclass(w.category, TrainingAlert)]
    assert not [f for f in upd.analyze(tmp_path / "plain.h5").findings if f.kind == "recorded_alerts"]


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_nan_alerts(tmp_path):
    caught, _ = train(tmp_path / "nan.h5", steps=12, nan_at=8)
    with upd.open_run(tmp_path / "nan.h5") as run:
        events = run.events()
    nan = events[events["kind"] == alert_rules.NONFINITE]
    assert 8 in set(nan["step"]) and "0.weight" in set(nan["param"])
    assert any("NaN/Inf" in str(w.message) for w in caught if issubclass(w.category, TrainingAlert))


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_warnings_are_rate_limited_when_the_band_is_left_on_every_step(tmp_path):
    # A band nothing fits: every weight is out of it at every step, and each step a bias spikes in turn.
    rules = AlertRules(low=-20.0, high=-19.0)
    caught, _ = train(tmp_path / "band.h5", steps=20, alerts=rules)
    alerts = [w for w in caught if issubclass(w.category, TrainingAlert)]
    assert 1 <= len(alerts) <= MAX_WARNINGS + 2
    with upd.open_run(tmp_path / "band.h5") as run:
        events = run.events()
        assert run.options["alerts"]["low"] == -20.0
    band = events[events["kind"] == alert_rules.OUT_OF_BAND]
    assert set(band["param"]) == WEIGHTS and set(band["step"]) == {0}  # one event per weight: it never came back


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_the_flight_recorder_dumps_on_an_alert(tmp_path):
    # spike_factor 1e9: the flight recorder's own total-norm rule never fires; the per-weight alert does.
    _, rec = train(tmp_path / "flight.h5", steps=SPIKE_STEP + 3, spike_at=SPIKE_STEP, flight_recorder=64,
                   spike_factor=1e9)
    reasons = [d["reason"] for d in rec.dumps]
    assert reasons and reasons[0].startswith(f"alert at step {SPIKE_STEP}")
    with upd.open_run(tmp_path / "flight.h5") as run:
        assert SPIKE_STEP in set(run.steps()["step"])  # its full record is in the file
    _, rec = train(tmp_path / "control.h5", steps=SPIKE_STEP + 3, spike_at=SPIKE_STEP, flight_recorder=64,
                   spike_factor=1e9, alerts=False)
    assert rec.dumps == []  # the dump above was the alert's: the flight recorder's own rule did not fire


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_live_checker_equals_check_step(spiked):
    """The vectorised live checker, fed the recorded statistics one step at a time, raises exactly the alerts
    check_step does, parameter by parameter (and fails when a rule differs: a changed threshold shows)."""
    path, _, _ = spiked
    with upd.open_run(path) as run:
        stats = run.stats()
        shapes = {r.param: tuple(r.shape) for r in run.params().itertuples()}
    names = sorted(shapes)
    weights_mask = np.array([alert_rules.is_weight(shapes[n]) for n in names])

    def both(rules):
        history, live = alert_rules.NormHistory(rules), LiveAlerts(rules)
        expected, got = [], []
        for step, rows in stats.sort_values("step").groupby("step"):
            values = {r["param"]: r.to_dict() for _, r in rows.iterrows()}
            expected += alert_rules.check_step(int(step), values, history, {n for n in names if len(shapes[n]) >= 2})
            columns = {c: np.array([values[n].get(c, np.nan) for n in names], dtype=np.float64)
                       for c in rows.columns if c not in ("optimizer", "param", "step")}
            got += live.check(0, int(step), 0.0, names, columns, weights_mask)
        return expected, got

    expected, got = both(AlertRules())
    assert sorted(map(repr, got)) == sorted(map(repr, expected)) and any(
        a.kind == alert_rules.UPDATE_SPIKE for a in got)
    assert sorted(map(repr, both(AlertRules(high=-2.8))[1])) != sorted(map(repr, expected))  # the check can fail


@pytest.mark.slow  # a real training run (the spiked one is shared by the module)
def test_a_hostile_events_table_is_refused(spiked, tmp_path):
    path, _, _ = spiked
    bad = tmp_path / "bad.h5"
    bad.write_bytes(path.read_bytes())
    with h5py.File(bad, "a") as f:
        del f[schema.EVENTS]
        f.create_dataset(schema.EVENTS, data=[json.dumps({"kind": 1})], dtype=h5py.string_dtype())
    with upd.open_run(bad) as run, pytest.raises(upd.RunFileError, match="events"):
        run.events()
    with h5py.File(bad, "a") as f:
        del f[schema.EVENTS]
        f.create_dataset(schema.EVENTS, data=["x" * (schema.MAX_EVENT_BYTES + 1)], dtype=h5py.string_dtype())
    with upd.open_run(bad) as run, pytest.raises(upd.RunFileError, match="limit"):
        run.events()


def run_live(names, ratio_at, steps):
    live, stored, texts = LiveAlerts(AlertRules()), [], []
    live.store = stored.extend
    for step in range(steps):
        live.check(0, step, 0.0, names, {alert_rules.UPDATE_TO_DATA: ratio_at(step)}, np.ones(len(names), bool))
        texts += live.take()[0]
    return live, stored, texts


def test_the_warnings_stay_bounded_when_alerts_come_and_go_on_every_step():
    """50 weights leaving the band at every other step for 200 steps: each return is a new alert, stored, but each
    (kind, weight) is warned about once. 200 weights leaving it one after the other: the warnings stop at
    MAX_WARNINGS plus one saying so, and the close counts them all."""
    names = [f"layer{i}.weight" for i in range(50)]
    live, stored, texts = run_live(names, lambda step: np.full(len(names), -1.0 if step % 2 == 0 else -3.0), 200)
    assert len(stored) == 50 * 100 and len(texts) == 1  # one warning names them all (the first 4, "and 46 more")
    assert "and 46 more" in texts[0]

    names = [f"layer{i}.weight" for i in range(200)]

    def one_out(step):
        ratio = np.full(len(names), -3.0)
        ratio[step] = -1.0
        return ratio
    live, stored, texts = run_live(names, one_out, 200)
    assert len(stored) == 200
    assert len(texts) == MAX_WARNINGS + 1 and "run.events()" in texts[-1]
    assert live.closing_text().startswith("torch-upd: 200 training alerts in all")
