"""What the commands print is bounded by the number of rows, never by the longest name: a run file's names are the
file's to choose (a 1 MB one included), and the terminal tables fit 100 columns unless --wide."""
import json

import h5py
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd.cli.info import INFO_PARAM_ROWS
from upd.cli.main import main
from upd.runfile import schema
from upd.safe_text import ELLIPSIS, LISTED_NAMES, MIN_NAME_CHARS, NAME_CHARS, TABLE_WIDTH, WIDE_CELL_CHARS, shorten, text_table

from tests.harness.paths import SAMPLE_RUNS

LONG = "x" * 1_000_000
ROWS = 20_000


def _frame(rows):
    names = [f"layers.{i}.attention.weight" for i in range(rows)] + [LONG, "esc\x1b[2Jape"]
    return pd.DataFrame({"param": names, "shape": ["64x64"] * len(names), "ratio": [-3.0] * len(names),
                         "other": [1.5] * len(names), "status": ["ok"] * len(names)})


def test_a_table_of_20000_names_and_one_of_1_mb_is_bounded_by_its_rows():
    frame = _frame(ROWS)
    text = text_table(frame, keep=["param", "ratio", "status"])
    lines = text.splitlines()
    assert len(lines) == len(frame) + 1
    assert max(map(len, lines)) <= TABLE_WIDTH
    assert len(text) <= (NAME_CHARS + 40) * len(lines)  # the 1 MB name costs what any other name costs
    assert f"xxxx{ELLIPSIS}xxxx" in lines[-2] and "\x1b" not in text and "esc\\x1b[2Jape" in lines[-1]
    wide = text_table(frame, wide=True)
    assert max(map(len, wide.splitlines())) <= WIDE_CELL_CHARS + 40


def test_narrow_tables_leave_out_columns_then_shorten_names_and_say_so():
    frame = _frame(2)
    text = text_table(frame, keep=["param", "ratio"], drop=["shape"], width=40)
    lines = text.splitlines()
    assert lines[0].split() == ["param", "ratio"]  # shape left out first, then from the last column back
    assert lines[-1] == "(left out to fit 40 columns: shape, other, status; --wide shows every column)"
    assert max(map(len, lines[:-1])) <= 40
    assert len(lines[1].split()[0]) >= MIN_NAME_CHARS
    assert "other" in text_table(frame, keep=["param"], width=40, wide=True).splitlines()[0]


def test_shorten_keeps_both_ends_and_is_bounded():
    assert shorten("model.layers.11.self_attn.q_proj.weight", 20) == "model.laye\u2026oj.weight"
    assert shorten("short") == "short"
    assert len(shorten(LONG)) == NAME_CHARS
    assert shorten("\x1b" * 1000, 12).startswith("\\x1b")


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """A real statistics-only run of 2,000 parameters and one named by 1 MB (a ParameterDict takes any key)."""
    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.ParameterDict({f"w{i}": nn.Parameter(torch.randn(2, 2)) for i in range(2000)})
            self.p[LONG] = nn.Parameter(torch.randn(3, 2))

    torch.manual_seed(0)
    model = Many()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path_factory.mktemp("crafted") / "many.h5")
    with upd.record(path, model, opt, every=None, stats_every=1):
        for _ in range(2):
            opt.zero_grad()
            sum((p ** 2).sum() for p in model.parameters()).backward()
            opt.step()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("command", [["info"], ["analyze", "--no-plots"], ["verify"], ["compare", "--no-plots"],
                                     ["advise"]])
def test_every_command_prints_bounded_output_for_a_1_mb_name(crafted, command):
    args = [command[0], crafted] + ([crafted] if command[0] == "compare" else []) + command[1:]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 3), result.output  # verify: statistics only, nothing verifiable
    lines = result.output.splitlines()
    # a line listing names (the verdict, frozen ones) names LISTED_NAMES of them, each shortened, and counts the rest
    assert max(map(len, lines)) <= LISTED_NAMES * (NAME_CHARS + 20) + 200, max(map(len, lines))
    assert len(result.output) <= 150 * 2001 + 10_000  # one bounded row per name, whatever the longest
    if command[0] in ("analyze", "compare"):
        rows = [line for line in lines if line.lstrip().startswith(("p.w1999 ", "p.xxxx"))]
        assert len(rows) == 2 and all(len(line) <= TABLE_WIDTH for line in rows)
    if command[0] == "info":  # the first INFO_PARAM_ROWS parameters, then a count (--wide lists every one)
        assert f"and {2001 - INFO_PARAM_ROWS} more parameters" in result.output
        assert all(len(line) <= TABLE_WIDTH for line in lines if line.lstrip().startswith("p.w"))


@pytest.fixture(scope="module")
def named_by_h5py(tmp_path_factory):
    """A statistics run whose '1.weight' is renamed to 1 MB with plain h5py: the recorder shortens the names it
    records (4096 characters), a file need not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path_factory.mktemp("named") / "long.h5")
    with upd.record(path, model, opt, every=None, stats_every=1):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
    with h5py.File(path, "r+") as f:
        table = f[schema.STATS_TABLE.path(k=0)]
        meta = json.loads(table.attrs[schema.STATS_PARAM_META])
        meta[LONG] = {**meta.pop("1.weight"), "name": LONG}
        table.attrs[schema.STATS_PARAM_META] = json.dumps(meta)
        table.attrs[schema.STATS_PARAMS] = json.dumps([LONG if n == "1.weight" else n
                                                       for n in json.loads(table.attrs[schema.STATS_PARAMS])])
    return path


@pytest.mark.parametrize("command", [["analyze", "--no-plots"], ["compare", "--no-plots"], ["verify"], ["advise"]])
def test_a_1_mb_name_written_with_plain_h5py_prints_bounded_output(named_by_h5py, command):
    args = [command[0], named_by_h5py] + ([named_by_h5py] if command[0] == "compare" else []) + command[1:]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 3), result.output  # verify: statistics only, nothing verifiable
    # a table row fits TABLE_WIDTH; advise's snippet (code to paste) keeps names up to WIDE_CELL_CHARS
    assert max(map(len, result.output.splitlines())) <= WIDE_CELL_CHARS + TABLE_WIDTH and len(result.output) <= 10_000, \
        (max(map(len, result.output.splitlines())), len(result.output))


def test_wide_shows_every_column():
    adam = [p for p in SAMPLE_RUNS if p.endswith("/adam.h5")][0]
    narrow = CliRunner().invoke(main, ["analyze", adam, "--no-plots"]).output
    wide = CliRunner().invoke(main, ["analyze", adam, "--no-plots", "--wide"]).output
    header = 1  # the table's second header line, after the findings block that comes first
    assert "--wide shows every column" in narrow and "records" not in narrow.split("\n\n")[1].splitlines()[header]
    assert "records" in wide.split("\n\n")[1].splitlines()[header] and "--wide shows" not in wide
    assert max(map(len, narrow.splitlines())) <= TABLE_WIDTH
