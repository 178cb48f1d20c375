"""TensorBoard output: a real recorded run exported, and the event files read back with TensorBoard's own reader."""
import builtins
import math
import sys

import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.integrations.tensorboard import INSTALL_HINT, TAGS, export_ratios
from upd.sinks import SinkStep, TensorBoard

from tests.harness.paths import SAMPLE_RUNS
from tests.harness.training import MLP, train_steps

SAMPLE = [p for p in SAMPLE_RUNS if p.endswith("/adam.h5")][0]

from torch.utils.tensorboard import SummaryWriter  # noqa: E402  (tensorboard is in the test extra)
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402


def read_scalars(logdir):
    """{tag: [(step, value), ...]} as TensorBoard itself reads the event files (no sampling: size_guidance 0)."""
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_scalars(ratios):
    """What export_ratios must write for a ratios table: finite values only, names prefixed for optimizer k > 0."""
    out = {}
    for r in ratios.sort_values(["step"], kind="stable").itertuples():
        name = r.param if r.optimizer == 0 else f"opt{r.optimizer}:{r.param}"
        for column in TAGS:
            value = getattr(r, column)
            if math.isfinite(value):
                out.setdefault(f"{column}/{name}", []).append((int(r.step), value))
    return out


def assert_same_scalars(got, expected):
    assert sorted(got) == sorted(expected)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, v_got), (step, v_exp) in zip(got[tag], points):
            # TensorBoard stores float32: the value read back is the float64 statistic rounded to float32
            assert v_got == float(np.float32(v_exp)), (tag, step)
            assert math.isfinite(v_got)


class WithScale(nn.Module):
    """The conftest MLP plus a one-element parameter: its update:data ratio is NaN (std of one number)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.mlp(x) * self.scale


def train(model, optimizers, steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for opt in optimizers:
            opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for opt in optimizers:
            opt.step()


@pytest.fixture(scope="module")
def adam_run(tmp_path_factory):
    torch.manual_seed(0)
    model = WithScale()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    path = str(tmp_path_factory.mktemp("tb") / "adam.h5")
    with upd.record(path, model, opt, every=1):
        train(model, [opt], steps=5)
    with upd.open_run(path) as run:
        return run.ratios()


def test_export_round_trips_through_tensorboard(adam_run, tmp_path):
    ratios = adam_run
    assert len(ratios) == 5 * 5 and sorted(ratios["step"].unique()) == [0, 1, 2, 3, 4]
    assert ratios.loc[ratios["param"] == "scale", "update_to_data"].isna().all()  # real non-finite values
    logdir = tmp_path / "logs"
    written = export_ratios(ratios, logdir)
    expected = expected_scalars(ratios)
    # 4 weights/biases x 5 tags + scale's 3 norms (its two ratios are NaN), at 5 steps each
    assert written == sum(len(v) for v in expected.values()) == (4 * 5 + 3) * 5
    got = read_scalars(logdir)
    assert_same_scalars(got, expected)
    assert "update_to_data/scale" not in got and "grad_to_data/scale" not in got
    assert "param_norm/scale" in got and "update_to_data/mlp.fc1.weight" in got


def test_export_several_optimizers_prefixes_names(tmp_path):
    torch.manual_seed(1)
    model = MLP()
    adam = torch.optim.Adam(model.fc1.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.fc2.parameters(), lr=0.1, momentum=0.9)
    path = str(tmp_path / "two.h5")
    with upd.record(path, model, [adam, sgd], every=1):
        train(model, [adam, sgd], steps=4)
    with upd.open_run(path) as run:
        ratios = run.ratios()
    assert sorted(ratios["optimizer"].unique()) == [0, 1]
    logdir = tmp_path / "logs"
    written = export_ratios(ratios, str(logdir))
    got = read_scalars(logdir)
    assert written == 4 * 4 * 5
    assert_same_scalars(got, expected_scalars(ratios))
    assert {t.split("/", 1)[1] for t in got} == {"fc1.weight", "fc1.bias", "opt1:fc2.weight", "opt1:fc2.bias"}


class FakeWriter:
    """Anything with SummaryWriter's add_scalar works as a target; records the calls."""

    def __init__(self):
        self.calls, self.flushed, self.closed = [], 0, False

    def add_scalar(self, tag, value, global_step=None, walltime=None):
        self.calls.append((global_step, tag, value))

    def flush(self):
        self.flushed += 1

    def close(self):
        self.closed = True


def test_export_writes_once_per_step_in_step_order(adam_run, monkeypatch):
    shuffled = adam_run.sample(frac=1.0, random_state=0)  # rows in any order
    steps_written = []
    original = TensorBoard.write

    def spy(self, steps):
        steps_written.append(sorted({s.step for s in steps}))
        return original(self, steps)

    monkeypatch.setattr(TensorBoard, "write", spy)
    writer = FakeWriter()
    assert export_ratios(shuffled, writer) == len(writer.calls) == (4 * 5 + 3) * 5
    assert steps_written == [[0], [1], [2], [3], [4]]
    assert [c[0] for c in writer.calls] == sorted(c[0] for c in writer.calls)
    assert not writer.closed and writer.flushed >= 1  # a given writer is flushed, never closed
    assert all(isinstance(v, float) and math.isfinite(v) for _, _, v in writer.calls)


def steps_at(step):
    """One step of two optimizers, with extra columns (ignored), non-finite, None and missing values (skipped)."""
    return [SinkStep(optimizer=0, step=step, wall_time=1.0e9, params={
                "fc1.weight": {"update_to_data": -3.25, "grad_to_data": -1.5, "update_norm": 0.01, "grad_norm": 2.0,
                               "param_norm": 5.0, "lr": 1e-3, "flag": ""},
                "scale": {"update_to_data": None, "param_norm": torch.tensor(1.25)}}),
            SinkStep(optimizer=1, step=step, wall_time=1.0e9, params={
                "head.bias": {"update_to_data": float("-inf"), "grad_to_data": float("nan"), "update_norm": 0.0,
                              "grad_norm": float("inf"), "param_norm": np.float32(0.5)}})]


STATS = steps_at(7)
STATS_EXPECTED = {
    "update_to_data/fc1.weight": [(7, -3.25)], "grad_to_data/fc1.weight": [(7, -1.5)],
    "update_norm/fc1.weight": [(7, 0.01)], "grad_norm/fc1.weight": [(7, 2.0)], "param_norm/fc1.weight": [(7, 5.0)],
    "update_norm/opt1:head.bias": [(7, 0.0)], "param_norm/opt1:head.bias": [(7, 0.5)],
    "param_norm/scale": [(7, 1.25)],
}


def test_sink_with_a_user_writer_leaves_it_open(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    sink = TensorBoard(writer)
    assert sink.writer is writer and not sink.owns_writer
    sink.write(STATS)
    assert sink.written == 8  # the NaN / inf / None / missing values are skipped
    sink.flush()
    sink.close()
    sink.close()
    assert writer.all_writers is not None  # not closed by us: the user keeps writing to it
    writer.add_scalar("user/own", 3.0, global_step=1)
    writer.close()
    got = read_scalars(tmp_path)
    assert got.pop("user/own") == [(1, 3.0)]
    assert_same_scalars(got, STATS_EXPECTED)
    with pytest.raises(ValueError, match="closed"):
        sink.write(steps_at(8))


def test_sink_with_a_logdir_owns_and_closes_its_writer(tmp_path):
    logdir = tmp_path / "nested" / "logs"
    with TensorBoard(logdir) as sink:  # a pathlib.Path; a str works the same (tested by the export tests)
        assert sink.owns_writer and isinstance(sink.writer, SummaryWriter)
        sink.write(STATS)
        sink.write([SinkStep(0, 8, 1.0e9, params={"fc1.weight": {"update_to_data": -3.0}})])
        sink.write([SinkStep(0, 9, 1.0e9)])
        assert sink.written == 9
    assert sink.closed and sink.writer.all_writers is None  # closed: the event file is complete
    expected = dict(STATS_EXPECTED, **{"update_to_data/fc1.weight": [(7, -3.25), (8, -3.0)]})
    assert_same_scalars(read_scalars(logdir), expected)


def test_float32_overflow_is_skipped_not_written_as_inf():
    writer = FakeWriter()
    sink = TensorBoard(writer)
    sink.write([SinkStep(0, 0, 1.0e9, params={"w": {"param_norm": 1e300, "grad_norm": 3.0e38}})])
    assert writer.calls == [(0, "grad_norm/w", 3.0e38)]


def test_bad_inputs(adam_run, tmp_path):
    with pytest.raises(TypeError, match="SummaryWriter or a log-dir path"):
        TensorBoard(42)
    with pytest.raises(ValueError, match="not a ratios table"):
        export_ratios(adam_run.drop(columns=["step"]), FakeWriter())
    writer = FakeWriter()
    assert export_ratios(adam_run.iloc[:0], writer) == 0 and writer.calls == []


def block_tensorboard_via_sys_modules(monkeypatch):
    """As if tensorboard were not installed: `import tensorboard` fails, torch.utils.tensorboard must re-import."""
    for name in list(sys.modules):
        if name == "tensorboard" or name.startswith(("tensorboard.", "torch.utils.tensorboard")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)


def block_tensorboard_via_import(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith(("tensorboard.", "torch.utils.tensorboard")):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


@pytest.mark.parametrize("block", [block_tensorboard_via_sys_modules, block_tensorboard_via_import])
def test_missing_tensorboard_gives_a_clear_import_error(block, adam_run, tmp_path, monkeypatch):
    block(monkeypatch)
    # re-import our module with tensorboard gone; monkeypatch puts the original module back afterwards
    monkeypatch.setattr(upd.integrations, "tensorboard", sys.modules["upd.integrations.tensorboard"])
    monkeypatch.setattr(upd.sinks, "tensorboard", sys.modules["upd.sinks.tensorboard"])
    monkeypatch.delitem(sys.modules, "upd.integrations.tensorboard")
    monkeypatch.delitem(sys.modules, "upd.sinks.tensorboard")
    import upd.integrations.tensorboard as tb  # importing the module itself never needs tensorboard
    import upd.sinks.tensorboard as sink_module

    for make in (lambda: sink_module.TensorBoard(tmp_path / "logs"),
                 lambda: tb.export_ratios(adam_run, str(tmp_path))):
        with pytest.raises(ImportError) as info:
            make()
        assert INSTALL_HINT in str(info.value) and 'pip install ".[tensorboard]"' in str(info.value)
        assert "tensorboard package" in str(info.value)
    assert not (tmp_path / "logs").exists()
    # a writer the user made needs no import from us
    writer = FakeWriter()
    assert tb.export_ratios(adam_run, writer) == len(writer.calls) > 0


def test_live_recording_writes_the_seed_questions_scalars(tmp_path):
    """upd.record(..., tensorboard=logdir): update:data and grad:data per parameter at every step, one line."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    logdir = tmp_path / "tb"
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=None, tensorboard=str(logdir)):
        train_steps(model, opt, steps=4)
    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})
    acc.Reload()
    stats = upd.open_run(path).stats().set_index(["param", "step"])
    for tag in ("update_to_data/fc1.weight", "grad_to_data/fc2.bias", "param_norm/fc1.bias"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [0, 1, 2, 3]
        column, name = tag.split("/")
        for e in events:
            assert e.value == pytest.approx(stats.loc[(name, e.step), column], rel=1e-6)


def test_analyze_cli_exports_tensorboard(tmp_path):
    from click.testing import CliRunner
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    from upd.cli.main import main

    result = CliRunner().invoke(main, ["analyze", SAMPLE, "--no-plots", "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 0, result.output
    assert "scalars in" in result.output
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={SCALARS: 0})
    acc.Reload()
    assert len(acc.Scalars("update_to_data/fc1.weight")) == 20


@pytest.mark.slow
def test_logged_scalars_are_written_live_and_by_the_export(tmp_path):
    """rec.log's values reach TensorBoard as scalars/<name>, live and from `upd analyze --tensorboard`, with the
    total gradient norms; the two agree with the run file."""
    from click.testing import CliRunner

    from upd.cli.main import main
    from upd.runfile import schema

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path, live_dir = str(tmp_path / "run.h5"), tmp_path / "live"
    with upd.record(path, model, opt, tensorboard=str(live_dir), every=1) as rec:
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            loss = nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))
            opt.zero_grad()
            loss.backward()
            rec.log(loss=loss)
            opt.step()
    with upd.open_run(path) as run:
        scalars = run.scalars()
    expected = {f"scalars/{name}": [(int(s), float(np.float32(v))) for s, v in zip(scalars["step"], scalars[name])]
                for name in ("loss", schema.SCALAR_GRAD_NORM_BACKWARD, schema.SCALAR_GRAD_NORM_AT_STEP)}
    live = read_scalars(live_dir)
    assert {tag: live[tag] for tag in expected} == expected
    assert len(expected["scalars/loss"]) == 5
    result = CliRunner().invoke(main, ["analyze", path, "--no-plots", "--tensorboard", str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    exported = read_scalars(tmp_path / "export")
    assert {tag: exported[tag] for tag in expected} == expected
    assert len(exported["update_to_data/fc1.weight"]) == len(live["update_to_data/fc1.weight"]) == 5
