"""Hostile and broken files: every reader entry point gives one clear line naming the file, and exit code 2.

`upd info|analyze|verify`, `upd.open_run`, `Run.ratios()` and `upd.verify()` on anything that is not a usable run
must fail with `RunFileError` (the CLI: exactly one line on stderr containing the path, exit code 2): never a
traceback, a hang or a huge allocation. A file that is still a valid run after a mutation must still be read
(0, 1 for a verify mismatch after a data corruption, 3 for nothing verifiable).

Two property tests mutate the committed sample runs, (a) byte by byte (truncation, flipped or overwritten byte
ranges) and (b) through h5py (deleted datasets and attributes, wrongly typed or garbage attributes, resized
datasets, changed dtypes, absurd shapes, newer format versions); explicit example tests cover each listed case.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import upd
from upd.runfile import schema
from upd.cli.main import main

from tests.harness.paths import REPO_ROOT, SAMPLE_DIR

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # the property tests need hypothesis; the example tests below run without it
    given = None

SAMPLES = ("adam.h5", "sgd_momentum.h5", "adamw_onecycle_two_groups.h5")
COMMANDS = (("info",), ("analyze", "--no-plots"), ("verify",))
VALID = {0, 1, 3}  # exit codes of a command that read a usable run
SECONDS_PER_COMMAND = 60.0  # each command on these ~1 MB files takes well under a second (margin: loaded CI)
PEAK_BYTES = 256 * 1024 * 1024  # Python/numpy memory one command may allocate (tracemalloc) on a ~1 MB file
HANG_SECONDS = 180  # watchdog: a hang inside HDF5 (C code, no Python signal gets in) dumps stacks and exits


def _without_parameter_index(folder: str) -> str:
    """Copies of the sample runs without their parameter index. The mutations here test the checks of the groups
    themselves: with an index, ``upd info`` lists a run from it and never opens the mutated groups, and analyze and
    verify refuse any difference from it before those checks run. The index's own hostile cases are in
    test_param_index_hostile.py."""
    for name in SAMPLES:
        shutil.copy(os.path.join(SAMPLE_DIR, name), os.path.join(folder, name))
        with h5py.File(os.path.join(folder, name), "r+") as f:
            for k in f[schema.OPTIMIZERS_GROUP.path()]:
                f[schema.PARAMS_GROUP.path(k=k)].attrs.pop(schema.PARAM_INDEX, None)
    return folder


UNINDEXED_SAMPLES = tempfile.TemporaryDirectory(prefix="upd-hostile-samples-")
UNINDEXED_DIR = _without_parameter_index(UNINDEXED_SAMPLES.name)


def sample_path(name: str) -> str:
    return os.path.join(UNINDEXED_DIR if name in SAMPLES else SAMPLE_DIR, name)


def run_command(args, path, *, measure_memory=False):
    """(exit code, stdout, stderr) of `upd ARGS PATH` through click's CliRunner, bounded in time and memory."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    if measure_memory:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        result = CliRunner().invoke(main, [*args, str(path)])
    finally:
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1] if measure_memory else 0
        if measure_memory:
            tracemalloc.stop()
        faulthandler.cancel_dump_traceback_later()
    assert elapsed < SECONDS_PER_COMMAND, (args, path, elapsed)
    assert peak < PEAK_BYTES, (args, path, peak)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"upd {' '.join(args)} {path} raised {result.exception!r}") from result.exception
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(args, path, code, out, err, words=()):
    """Exit 2 with exactly one line, on stderr, naming the file; the reader's own message, not a crash."""
    assert code == 2, (args, path, code, out, err)
    assert out == "", (args, out)
    lines = err.splitlines()
    assert len(lines) == 1, (args, err)
    line = lines[0]
    assert str(path) in line, (args, line)
    assert "Traceback" not in line and "UPD_DEBUG" not in line, (args, line)  # UPD_DEBUG: an unexpected exception
    assert "Unable to allocate" not in line and "MemoryError" not in line, (args, line)
    for word in words:
        assert word in line, (args, word, line)
    return line


def check_all_commands(path, allowed: dict | None = None, words=(), measure_memory=False):
    """Run every command on path. allowed: command name -> allowed exit codes (default: only 2)."""
    codes = {}
    for args in COMMANDS:
        code, out, err = run_command(args, path, measure_memory=measure_memory)
        ok = (allowed or {}).get(args[0], {2})
        assert code in ok, (args, path, code, out, err)
        if code == 2:
            assert_one_line_error(args, path, code, out, err, words)
        else:
            assert "Traceback" not in out + err
        codes[args[0]] = code
    return codes


def check_api(path, words=()):
    """upd.open_run + ratios() + upd.verify(): RunFileError naming the file, one line, or success."""
    try:
        with upd.open_run(path) as run:
            run.describe()
            run.ratios()
        upd.verify(path)
    except upd.RunFileError as exc:
        message = str(exc)
        assert "\n" not in message and str(path) in message, message
        for word in words:
            assert word in message, (word, message)
        return False
    return True


# -- where the bytes are ---------------------------------------------------------------------------------------

def _data_ranges(path: str) -> list[tuple[int, int]]:
    """File byte ranges holding the raw values of tensor datasets (param, grad, param_after, state/*)."""
    ranges = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and obj.dtype.kind == "f" and f"/{schema.PARAMS}/" in name \
                and not name.endswith(f"/{schema.STATE_GROUP}/step"):  # Adam's step counter: not tensor data
            for i in range(obj.id.get_num_chunks()):
                info = obj.id.get_chunk_info(i)
                ranges.append((info.byte_offset, info.byte_offset + info.size))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return sorted(ranges)


def _gaps(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The byte ranges between the given ones: everything that is not tensor data."""
    gaps, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < size:
        gaps.append((at, size))
    return gaps


DATA_RANGES = {name: _data_ranges(sample_path(name)) for name in SAMPLES}
SIZES = {name: os.path.getsize(sample_path(name)) for name in SAMPLES}
METADATA_RANGES = {name: _gaps(DATA_RANGES[name], SIZES[name]) for name in SAMPLES}


def _inside_data(name: str, start: int, stop: int) -> bool:
    return any(lo <= start and stop <= hi for lo, hi in DATA_RANGES[name])


def _copy(name: str, directory: str) -> str:
    dst = os.path.join(directory, "hostile run.h5")  # a space in the name: the path must still be quoted whole
    shutil.copy(sample_path(name), dst)
    return dst


# -- property test (a): byte-level mutations ------------------------------------------------------------------

if given is not None:
    # UPD_HOSTILE_EXAMPLES=2000 fuzzes longer than CI does (each strategy, same assertions).
    # deadline: per example (three commands, and the API on a refused file); each command is also bounded above.
    FAST = settings(max_examples=int(os.environ.get("UPD_HOSTILE_EXAMPLES", "60")), deadline=180_000,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

    @FAST
    @given(name=st.sampled_from(SAMPLES), fraction=st.floats(0.0, 1.0, exclude_max=True))
    def test_truncated_runs_are_refused(name, fraction):
        with tempfile.TemporaryDirectory() as tmp:
            path = _copy(name, tmp)
            cut = int(fraction * SIZES[name])
            with open(path, "r+b") as f:
                f.truncate(cut)
            words = ("empty",) if cut == 0 else ()
            check_all_commands(path, words=words)
            assert check_api(path) is False

    @st.composite
    def byte_edits(draw):
        name = draw(st.sampled_from(SAMPLES))
        size = SIZES[name]
        edits = []
        for _ in range(draw(st.integers(1, 3))):
            where = draw(st.sampled_from(["data", "metadata", "anywhere", "head"]))
            length = draw(st.integers(1, 64))
            if where == "data":
                lo, hi = draw(st.sampled_from(DATA_RANGES[name]))
                start = draw(st.integers(lo, max(lo, hi - length)))
            elif where == "head":  # superblock and root object header
                start = draw(st.integers(0, 4096))
            elif where == "metadata":  # bytes outside the tensors' raw data: headers, B-trees, heaps, attributes
                lo, hi = draw(st.sampled_from(METADATA_RANGES[name]))
                start = draw(st.integers(lo, hi - 1))
            else:
                start = draw(st.integers(0, size - 1))
            length = min(length, size - start)
            how = draw(st.sampled_from(["xor", "random", "zero", "ones"]))
            payload = draw(st.binary(min_size=length, max_size=length))
            edits.append((start, length, how, payload))
        return name, edits

    @pytest.mark.slow
    @FAST
    @given(case=byte_edits())
    def test_flipped_and_overwritten_bytes(case):
        name, edits = case
        with tempfile.TemporaryDirectory() as tmp:
            path = _copy(name, tmp)
            with open(path, "r+b") as f:
                data = bytearray(f.read())
                for start, length, how, payload in edits:
                    old = data[start:start + length]
                    new = {"xor": bytes(a ^ (b | 1) for a, b in zip(old, payload)), "random": payload,
                           "zero": bytes(length), "ones": b"\xff" * length}[how]
                    data[start:start + length] = new
                f.seek(0)
                f.write(data)
            only_data = all(_inside_data(name, s, s + n) for s, n, _, _ in edits)
            # Corrupted tensor values leave a valid run: read it, and verify may report a mismatch. Anything else
            # may or may not still be a run, but is never a crash.
            allowed = {"info": {0}, "analyze": {0}, "verify": {0, 1}} if only_data else \
                {c: VALID | {2} for c in ("info", "analyze", "verify")}
            codes = check_all_commands(path, allowed)
            if codes["info"] == 2:  # refused on open: every entry point refuses it the same way
                assert set(codes.values()) == {2}, codes


def test_the_test_extra_installs_hypothesis_so_the_property_tests_run():
    """The property tests exist only where hypothesis imports. CI installs the `test` extra, so that extra must list
    hypothesis, or CI would drop them without a word. Where hypothesis is missing, this test says so as a skip."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        test_extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    assert "hypothesis" in {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() for req in test_extra}, test_extra
    if given is None:
        pytest.skip("hypothesis is not installed: the property tests did not run (pip install '.[test]')")


# -- property test (b): structure-level mutations with h5py -------------------------------------------------

# Every path below is looked up in the schema: a name the schema does not declare fails here, not in a mutation.
OPT = schema.OPTIMIZER.path(k=0)
REC = schema.RECORD_TABLE.path(k=0)
PARAMS = schema.OPTIMIZER.at(schema.PARAMS, k=0)
P = schema.PARAMETER.path(k=0, name="fc1.weight")  # every sample has it


def rec(column: str) -> str:
    """Path of a record-table column of optimizer 0."""
    return schema.RECORD_TABLE.at(column, k=0)


def par(member: str) -> str:
    """Path of a member of parameter fc1.weight's group."""
    return schema.PARAMETER.at(member, k=0, name="fc1.weight")


REC_STEP, REC_BACKWARD_PASS, REC_WALL_TIME, REC_LR, REC_HPARAMS = (
    rec(c) for c in (schema.STEP, schema.BACKWARD_PASS, schema.WALL_TIME, schema.LR, schema.HPARAMS))
P_RECORD, P_PARAM, P_GRAD, P_AFTER, P_STATE, P_PRESENT = (
    par(m) for m in (schema.RECORD_INDEX, schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER,
                     schema.STATE_GROUP, schema.STATE_PRESENT))


def last_state_key(f) -> str:
    """Path of the last state dataset of fc1.weight (its key from the state group's key list)."""
    return P_STATE + "/" + json.loads(f[P_STATE].attrs[schema.STATE_KEYS])[-1]


BROKEN = {"info": {2}, "analyze": {2}, "verify": {2}}
STILL_VALID = {"info": {0}, "analyze": {0}, "verify": VALID}
LAZY = {"info": {0}, "analyze": {0}, "verify": {2}}  # only verify reads it (hparams)
# A parameter's tensor and state datasets are checked when first read (validate.ParamDatasets): `info` reads none
# but the 'param' dataset's dtype, so it shows the file; analyze and verify, which read them, refuse it.
TENSORS_LAZY = {"info": {0}, "analyze": {2}, "verify": {2}}


def _replace_dataset(f, name, data, attrs=None, **kwargs):
    old_attrs = dict(f[name].attrs) if attrs is None else attrs
    del f[name]
    ds = f.create_dataset(name, data=data, **kwargs)
    for k, v in old_attrs.items():
        ds.attrs[k] = v


def _set_meta(f, where, **changes):
    meta = json.loads(f[where].attrs[schema.ATTR_META])
    meta.update(changes)
    f[where].attrs[schema.ATTR_META] = json.dumps(meta)


BIG = 2 ** 40  # rows or columns no ~1 MB file can hold

# (description, mutation(f), expected exit codes per command)
STRUCTURE_MUTATIONS = [
    # missing datasets, groups, attributes
    ("delete records/step", lambda f: f.__delitem__(REC_STEP), BROKEN),
    ("delete records/backward_pass", lambda f: f.__delitem__(REC_BACKWARD_PASS), BROKEN),
    ("delete records/wall_time", lambda f: f.__delitem__(REC_WALL_TIME), BROKEN),
    ("delete records/lr", lambda f: f.__delitem__(REC_LR), BROKEN),
    ("delete records/hparams", lambda f: f.__delitem__(REC_HPARAMS), BROKEN),
    ("delete records group", lambda f: f.__delitem__(REC), BROKEN),
    ("delete params group", lambda f: f.__delitem__(PARAMS), BROKEN),
    ("delete optimizers group", lambda f: f.__delitem__(schema.OPTIMIZERS), BROKEN),
    ("delete record index", lambda f: f.__delitem__(P_RECORD), BROKEN),
    ("delete state_present", lambda f: f.__delitem__(P_PRESENT), BROKEN),
    ("delete a state dataset", lambda f: f.__delitem__(last_state_key(f)),
     {"info": {0, 2}, "analyze": {0, 2}, "verify": {2}}),
    ("delete closure_losses (optional)", lambda f: f[REC].pop(schema.CLOSURE_LOSSES, None), STILL_VALID),
    ("delete param_after (what= may omit it)", lambda f: f.__delitem__(P_AFTER), STILL_VALID),
    ("delete the state group", lambda f: f.__delitem__(P_STATE), STILL_VALID),
    ("delete root format attr", lambda f: f.attrs.__delitem__(schema.ATTR_FORMAT), BROKEN),
    ("delete root format_version attr", lambda f: f.attrs.__delitem__(schema.ATTR_VERSION), BROKEN),
    ("delete root meta attr", lambda f: f.attrs.__delitem__(schema.ATTR_META), BROKEN),
    ("delete params_not_optimized (optional)", lambda f: f.attrs.__delitem__(schema.ATTR_PARAMS_NOT_OPTIMIZED),
     STILL_VALID),
    ("delete optimizer meta", lambda f: f[OPT].attrs.__delitem__(schema.ATTR_META), BROKEN),
    ("delete param meta", lambda f: f[P].attrs.__delitem__(schema.ATTR_META), BROKEN),
    # wrongly typed attributes, garbage and huge JSON
    ("format attr is an int", lambda f: f.attrs.__setitem__(schema.ATTR_FORMAT, 7), BROKEN),
    ("format_version is a string", lambda f: f.attrs.__setitem__(schema.ATTR_VERSION, "1"), BROKEN),
    ("format_version is an array", lambda f: f.attrs.__setitem__(schema.ATTR_VERSION, np.arange(3)), BROKEN),
    ("format_version 99", lambda f: f.attrs.__setitem__(schema.ATTR_VERSION, 99), BROKEN),
    ("format_version 0", lambda f: f.attrs.__setitem__(schema.ATTR_VERSION, 0), BROKEN),
    ("root meta is an int", lambda f: f.attrs.__setitem__(schema.ATTR_META, 5), BROKEN),
    ("root meta is a JSON list", lambda f: f.attrs.__setitem__(schema.ATTR_META, "[1, 2]"), BROKEN),
    ("root meta is garbage", lambda f: f.attrs.__setitem__(schema.ATTR_META, "{not json"), BROKEN),
    ("root meta is invalid UTF-8", lambda f: f.attrs.__setitem__(schema.ATTR_META, np.bytes_(b"{\"a\": \"\xff\xfe\"}")),
     BROKEN),
    ("root meta nested 100000 deep",
     lambda f: f.attrs.__setitem__(schema.ATTR_META, "[" * 100_000 + "]" * 100_000), BROKEN),
    ("root meta larger than MAX_META_BYTES",
     lambda f: f.attrs.__setitem__(schema.ATTR_META, '{"x": "' + "a" * schema.MAX_META_BYTES + '"}'), BROKEN),
    ("root meta: torch_version a number", lambda f: _set_meta(f, "/", torch_version=2.1), BROKEN),
    ("root meta: torch_version 5000 digits", lambda f: _set_meta(f, "/", torch_version="2." + "9" * 5000), BROKEN),
    ("root meta: a lone surrogate escape", lambda f: _set_meta(f, "/", torch_version="\udcff"), BROKEN),
    ("hparams with invalid UTF-8", lambda f: f[REC_HPARAMS].__setitem__(
        1, np.array(b'[{"lr": "\xff\xfe"}]', dtype=h5py.string_dtype("utf-8"))), LAZY),
    ("a parameter named with invalid UTF-8", lambda f: f[PARAMS].move("fc1.bias", b"fc1.\xff"), BROKEN),
    ("root meta: created_unix absurd", lambda f: _set_meta(f, "/", created_unix=1e300), BROKEN),
    ("root meta: created_unix a string", lambda f: _set_meta(f, "/", created_unix="yesterday"), BROKEN),
    ("root meta: options a list", lambda f: _set_meta(f, "/", options=[1]), BROKEN),
    ("root meta: options.what a number", lambda f: _set_meta(f, "/", options={"what": 5}), BROKEN),
    ("params_not_optimized garbage", lambda f: f.attrs.__setitem__(schema.ATTR_PARAMS_NOT_OPTIMIZED, "{{"), BROKEN),
    ("params_not_optimized a dict",
     lambda f: f.attrs.__setitem__(schema.ATTR_PARAMS_NOT_OPTIMIZED, '{"a": 1}'), BROKEN),
    ("optimizer meta is garbage", lambda f: f[OPT].attrs.__setitem__(schema.ATTR_META, "\x01\x02 not json"), BROKEN),
    ("optimizer meta: class a number", lambda f: _set_meta(f, OPT, **{"class": 3}), BROKEN),
    ("optimizer meta: mro a string", lambda f: _set_meta(f, OPT, mro=17), BROKEN),
    ("param meta is an array", lambda f: f[P].attrs.__setitem__(schema.ATTR_META, np.zeros(4)), BROKEN),
    ("param meta: group a string", lambda f: _set_meta(f, P, group="zero"), BROKEN),
    ("param meta: group out of range", lambda f: _set_meta(f, P, group=7), BROKEN),
    ("param meta: index_in_group a list", lambda f: _set_meta(f, P, index_in_group=[1]), BROKEN),
    ("param meta: dtype a list", lambda f: _set_meta(f, P, dtype=[1]), BROKEN),
    ("state keys garbage", lambda f: f[P_STATE].attrs.__setitem__(schema.STATE_KEYS, "[["), BROKEN),
    ("state keys not strings", lambda f: f[P_STATE].attrs.__setitem__(schema.STATE_KEYS, "[1, 2]"), BROKEN),
    ("torch_dtype bfloat16 on float32 data",
     lambda f: f[P_PARAM].attrs.__setitem__(schema.ATTR_TORCH_DTYPE, "bfloat16"), BROKEN),
    ("torch_dtype unknown", lambda f: f[P_GRAD].attrs.__setitem__(schema.ATTR_TORCH_DTYPE, "os.system"), TENSORS_LAZY),
    ("torch_dtype a number", lambda f: f[P_AFTER].attrs.__setitem__(schema.ATTR_TORCH_DTYPE, 4), TENSORS_LAZY),
    ("hparams JSON garbage at one record", lambda f: f[REC_HPARAMS].__setitem__(3, "{garbage"), LAZY),
    ("hparams JSON a number", lambda f: f[REC_HPARAMS].__setitem__(0, "17"), LAZY),
    ("hparams JSON list of numbers", lambda f: f[REC_HPARAMS].__setitem__(2, "[1, 2]"), LAZY),
    ("hparams JSON without lr", lambda f: f[REC_HPARAMS].__setitem__(2, "[{}]"), LAZY),
    ("hparams JSON nested deep", lambda f: f[REC_HPARAMS].__setitem__(1, "[" * 50_000), LAZY),
    # absurd shapes in meta JSON
    ("meta shape 2**62 x 2**62", lambda f: _set_meta(f, P, shape=[2 ** 62, 2 ** 62]), BROKEN),
    ("meta shape negative", lambda f: _set_meta(f, P, shape=[-20, 64]), BROKEN),
    ("meta shape a string", lambda f: _set_meta(f, P, shape="20x64"), BROKEN),
    ("meta shape floats", lambda f: _set_meta(f, P, shape=[20.0, 64.5]), BROKEN),
    ("meta shape 10**30", lambda f: _set_meta(f, P, shape=[10 ** 30]), BROKEN),
    ("meta shape rank 40", lambda f: _set_meta(f, P, shape=[1] * 40), BROKEN),
    ("meta shape transposed", lambda f: _set_meta(f, P, shape=[64, 20]), TENSORS_LAZY),
    # resized datasets
    ("records/step one row longer", lambda f: f[REC_STEP].resize((f[REC_STEP].shape[0] + 1,)), BROKEN),
    ("records/step shorter (fewer committed records)", lambda f: f[REC_STEP].resize((5,)), STILL_VALID),
    ("records/step empty", lambda f: f[REC_STEP].resize((0,)), {"info": {0}, "analyze": {0}, "verify": {3}}),
    ("records/step 2**40 rows", lambda f: f[REC_STEP].resize((BIG,)), BROKEN),
    ("records/hparams shorter than step", lambda f: f[REC_HPARAMS].resize((3,)), BROKEN),
    ("records/lr with 2**40 groups", lambda f: f[REC_LR].resize(BIG, axis=1), BROKEN),
    ("records/lr with no groups", lambda f: f[REC_LR].resize(0, axis=1), BROKEN),
    ("records/wall_time 2**40 rows (ignored beyond step)", lambda f: f[REC_WALL_TIME].resize((BIG,)),
     STILL_VALID),
    ("record index 2**40 rows", lambda f: f[P_RECORD].resize((BIG,)), BROKEN),
    # rows past the committed ones that read as the fill value: what a kill mid-record leaves (tests/harness/kill.py,
    # AIMED_CHILD), read as uncommitted
    ("record index padded with zeros", lambda f: f[P_RECORD].resize((30,)), STILL_VALID),
    ("record index shorter (fewer rows)", lambda f: f[P_RECORD].resize((7,)), STILL_VALID),
    ("param rows fewer than records", lambda f: f[P_PARAM].resize(4, axis=0), TENSORS_LAZY),
    ("grad rows 2**40 (ignored beyond the records)", lambda f: f[P_GRAD].resize(BIG, axis=0), STILL_VALID),
    ("state_present 2**40 columns", lambda f: f[P_PRESENT].resize(BIG, axis=1), TENSORS_LAZY),
    ("state dataset shorter than its present rows",
     lambda f: f[last_state_key(f)].resize(2, axis=0),
     {"info": {0, 2}, "analyze": {0, 2}, "verify": {2}}),
    # record index values
    ("record index decreasing", lambda f: f[P_RECORD].__setitem__(slice(None), f[P_RECORD][()][::-1]),
     BROKEN),
    ("record index negative", lambda f: f[P_RECORD].__setitem__(0, -5), BROKEN),
    # changed dtypes
    ("records/step float", lambda f: _replace_dataset(f, REC_STEP, f[REC_STEP][()].astype("f8")),
     BROKEN),
    ("records/step int32 (still integers)",
     lambda f: _replace_dataset(f, REC_STEP, f[REC_STEP][()].astype("i4")), STILL_VALID),
    ("records/step 2-D", lambda f: _replace_dataset(f, REC_STEP, f[REC_STEP][()][:, None]), BROKEN),
    ("records/step strings", lambda f: _replace_dataset(f, REC_STEP, [b"a"] * 20), BROKEN),
    ("records/lr 1-D", lambda f: _replace_dataset(f, REC_LR, f[REC_LR][:, 0]), BROKEN),
    ("records/hparams integers", lambda f: _replace_dataset(f, REC_HPARAMS, np.arange(20)), BROKEN),
    ("record index float", lambda f: _replace_dataset(f, P_RECORD, f[P_RECORD][()].astype("f4")),
     BROKEN),
    ("param as int32 data", lambda f: _replace_dataset(f, P_PARAM, f[P_PARAM][()].astype("i4")), BROKEN),
    ("param as float64 data under torch_dtype float32",
     lambda f: _replace_dataset(f, P_PARAM, f[P_PARAM][()].astype("f8")), BROKEN),
    ("param as float64 data and torch_dtype float64",
     lambda f: _replace_dataset(f, P_PARAM, f[P_PARAM][()].astype("f8"),
                                attrs={"torch_dtype": "float64", "source_dtype": "float32"}), STILL_VALID),
    ("param as strings", lambda f: _replace_dataset(f, P_PARAM, np.array([b"x"] * 20)), BROKEN),
    ("param as compound", lambda f: _replace_dataset(
        f, P_PARAM, np.zeros((20, 20, 64), dtype=[("a", "f4"), ("b", "i4")])), BROKEN),
    ("param trailing shape differs", lambda f: _replace_dataset(f, P_GRAD, f[P_GRAD][:, :, :10]), TENSORS_LAZY),
    ("state_present 1-D", lambda f: _replace_dataset(f, P_PRESENT, np.ones(20, "u1")), TENSORS_LAZY),
    ("a group where a dataset belongs", lambda f: (f.__delitem__(REC_WALL_TIME),
                                                   f.create_group(REC_WALL_TIME)), BROKEN),
    ("a dataset where a group belongs", lambda f: (f.__delitem__(P_STATE),
                                                   f.create_dataset(P_STATE, data=[1])), BROKEN),
    ("an optimizer named 'x'", lambda f: f.move(OPT, f"/{schema.OPTIMIZERS}/x"), BROKEN),
    ("an external link to another file", lambda f: (f.__delitem__(REC_WALL_TIME), f.__setitem__(
        REC_WALL_TIME, h5py.ExternalLink("/etc/hostname", "/x"))), BROKEN),
    ("a soft link loop", lambda f: (f.__delitem__(PARAMS), f.__setitem__(
        PARAMS, h5py.SoftLink(PARAMS))), BROKEN),
    # a parameter's members are looked up in one pass over its group's links: each kind of link is still refused
    ("record index a soft link", lambda f: (f.__delitem__(P_RECORD), f.__setitem__(P_RECORD, h5py.SoftLink(
        f"/{REC_STEP}"))), BROKEN),
    ("param an external link", lambda f: (f.__delitem__(P_PARAM), f.__setitem__(
        P_PARAM, h5py.ExternalLink("/etc/hostname", "/x"))), BROKEN),
    ("grad a soft link to param", lambda f: (f.__delitem__(P_GRAD), f.__setitem__(P_GRAD, h5py.SoftLink(
        f"/{P_PARAM}"))), BROKEN),
    ("state group an external link", lambda f: (f.__delitem__(P_STATE), f.__setitem__(
        P_STATE, h5py.ExternalLink("/etc/hostname", "/s"))), BROKEN),
    ("state_present a soft link", lambda f: (f.__delitem__(P_PRESENT), f.__setitem__(
        P_PRESENT, h5py.SoftLink(f"/{P_RECORD}"))), BROKEN),
    # data only: still a valid run, verify sees the corruption
    ("param_after values changed", lambda f: f[P_AFTER].__setitem__(5, f[P_AFTER][5] * 1.5),
     {"info": {0}, "analyze": {0}, "verify": {1}}),
    ("NaN gradients", lambda f: f[P_GRAD].__setitem__(2, np.nan), {"info": {0}, "analyze": {0}, "verify": {1}}),
    ("unknown extra groups and attrs are ignored", lambda f: (f.create_group(f"{OPT}/stats_from_the_future"),
                                                              f[OPT].attrs.__setitem__("novel", "x")), STILL_VALID),
]


def _mutate(path, mutation):
    with h5py.File(path, "r+") as f:
        mutation(f)


if given is not None:
    @pytest.mark.slow
    @FAST
    @given(name=st.sampled_from(SAMPLES), index=st.integers(0, len(STRUCTURE_MUTATIONS) - 1))
    def test_structure_mutations(name, index):
        what, mutation, allowed = STRUCTURE_MUTATIONS[index]
        with tempfile.TemporaryDirectory() as tmp:
            path = _copy(name, tmp)
            _mutate(path, mutation)
            codes = check_all_commands(path, allowed, measure_memory=True)
            if 2 in codes.values():
                assert check_api(path) is False, (what, codes)


@pytest.mark.parametrize("what, mutation, allowed", STRUCTURE_MUTATIONS, ids=[m[0] for m in STRUCTURE_MUTATIONS])
def test_each_structure_mutation_on_adam(tmp_path, what, mutation, allowed):
    """Every structure-level mutation, once, on the Adam sample (the property test mixes them over samples)."""
    path = _copy("adam.h5", str(tmp_path))
    _mutate(path, mutation)
    codes = check_all_commands(path, allowed)
    if 2 in codes.values():
        assert check_api(path) is False, (what, codes)


# -- the per-step statistics table (recorded with stats_every=) -----------------------------------------------

ST = schema.STATS_TABLE.path(k=0)


def stat(column: str) -> str:
    """Path of a statistics-table column of optimizer 0."""
    return schema.STATS_TABLE.at(column, k=0)


ST_VALUES = stat(schema.VALUES)


def _set_stats_attr(f, name, transform):
    f[ST].attrs[name] = json.dumps(transform(json.loads(f[ST].attrs[name])))


def _first_param_meta(f, **changes):
    meta = json.loads(f[ST].attrs[schema.STATS_PARAM_META])
    meta[next(iter(meta))].update(changes)
    f[ST].attrs[schema.STATS_PARAM_META] = json.dumps(meta)


STATS_ONLY = {"info": {0}, "analyze": {0}, "verify": {3}}  # verify: nothing to replay without full tensors
STATS_MUTATIONS = [
    ("unchanged", lambda f: None, STATS_ONLY),
    ("values with 2**40 parameter slots", lambda f: f[ST_VALUES].resize(BIG, axis=1), BROKEN),
    ("values with 2**40 columns", lambda f: f[ST_VALUES].resize(BIG, axis=2), BROKEN),
    ("stats/step 2**40 rows", lambda f: f[stat(schema.STEP)].resize((BIG,)), BROKEN),
    ("stats/step longer than values", lambda f: f[stat(schema.STEP)].resize((9,)), BROKEN),
    ("stats/lr with 2**40 groups", lambda f: f[stat(schema.LR)].resize(BIG, axis=1), BROKEN),
    ("values as integers",
     lambda f: _replace_dataset(f, ST_VALUES, np.nan_to_num(f[ST_VALUES][()]).astype("i4")), BROKEN),
    ("values 2-D", lambda f: _replace_dataset(f, ST_VALUES, f[ST_VALUES][:, 0, :]), BROKEN),
    ("params attr garbage", lambda f: f[ST].attrs.__setitem__(schema.STATS_PARAMS, "[["), BROKEN),
    ("params attr missing", lambda f: f[ST].attrs.__delitem__(schema.STATS_PARAMS), BROKEN),
    ("columns not strings", lambda f: f[ST].attrs.__setitem__(schema.STATS_COLUMNS, "[1, 2, 3]"), BROKEN),
    ("columns fewer than values' columns", lambda f: _set_stats_attr(f, schema.STATS_COLUMNS, lambda c: c[:-1]),
     BROKEN),
    ("duplicate parameter names", lambda f: _set_stats_attr(f, schema.STATS_PARAMS, lambda c: [c[0]] * len(c)), BROKEN),
    ("param_meta absurd shape", lambda f: _first_param_meta(f, shape=[2 ** 62, 2 ** 62]), BROKEN),
    ("param_meta group a string", lambda f: _first_param_meta(f, group="g"), BROKEN),
    ("param_meta a list", lambda f: f[ST].attrs.__setitem__(schema.STATS_PARAM_META, "[1]"), BROKEN),
    ("stats is an external link", lambda f: (f.move(ST, f"{OPT}/old_stats"),
                                             f.__setitem__(ST, h5py.ExternalLink("/etc/hostname", "/s"))), BROKEN),
    ("values all NaN (no parameter had a gradient)", lambda f: f[ST_VALUES].__setitem__(slice(None), np.nan),
     STATS_ONLY),
    ("no values yet (table not started)", lambda f: f.__delitem__(ST_VALUES), STATS_ONLY),
    ("stats/backward_pass shorter than the steps", lambda f: f[stat(schema.BACKWARD_PASS)].resize((1,)), BROKEN),
    ("stats/backward_pass float", lambda f: _replace_dataset(f, stat(schema.BACKWARD_PASS),
                                                             f[stat(schema.BACKWARD_PASS)][()].astype("f8")), BROKEN),
    ("stats/hparams missing", lambda f: f.__delitem__(stat(schema.HPARAMS)), BROKEN),
    ("stats/hparams not JSON (groups unknown, the rest reads)",
     lambda f: f[stat(schema.HPARAMS)].__setitem__(slice(None), "[["), STATS_ONLY),
]


@pytest.mark.parametrize("what, mutation, allowed", STATS_MUTATIONS, ids=[m[0] for m in STATS_MUTATIONS])
def test_statistics_table_mutations(tmp_path, stats_run, what, mutation, allowed):
    path = str(tmp_path / "stats run.h5")
    shutil.copy(stats_run, path)
    _mutate(path, mutation)
    codes = check_all_commands(path, allowed, measure_memory=True)
    if 2 in codes.values():
        assert check_api(path) is False, (what, codes)
    else:
        with upd.open_run(path) as run:
            run.stats()


# -- explicit examples of each listed case -------------------------------------------------------------------

def test_non_hdf5_file(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("this is a text file, not HDF5\n" * 100)
    check_all_commands(path, words=("not a readable HDF5 file",))
    assert check_api(path) is False


def test_empty_file(tmp_path):
    path = tmp_path / "empty.h5"
    path.write_bytes(b"")
    check_all_commands(path, words=("empty",))


@pytest.mark.parametrize("cut", [1, 7, 8, 96, 512, 2048, 4096, 65536, 300_000, -4096, -1])
def test_truncated_run(tmp_path, cut):
    path = _copy("adam.h5", str(tmp_path))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(cut if cut > 0 else size + cut)
    check_all_commands(path)
    assert check_api(path) is False


def test_hdf5_file_from_another_tool(tmp_path):
    path = tmp_path / "weights.h5"
    with h5py.File(path, "w") as f:
        f["model/layer1/kernel"] = np.zeros((3, 3))
        f.attrs[schema.ATTR_FORMAT] = "keras"
    check_all_commands(path, words=("not a torch-upd run",))


def test_newer_format_version(tmp_path):
    path = _copy("sgd_momentum.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        f.attrs[schema.ATTR_VERSION] = 99
    check_all_commands(path, words=("version 99", "upgrade torch-upd"))
    assert check_api(path, words=("version 99",)) is False


def test_directory(tmp_path):
    check_all_commands(tmp_path, words=("directory",))
    assert check_api(str(tmp_path)) is False


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_is_refused_without_blocking(tmp_path):
    """A named pipe would block an open() forever: refused before anything opens it."""
    path = tmp_path / "pipe.h5"
    os.mkfifo(path)
    check_all_commands(path, words=("not a regular file",))


def test_missing_path(tmp_path):
    check_all_commands(tmp_path / "nope.h5", words=("no such file",))
    assert check_api(str(tmp_path / "nope.h5")) is False


def test_permission_denied_simulated(tmp_path, monkeypatch):
    """Root reads every file, so the permission check is simulated: os.access says no."""
    path = _copy("adam.h5", str(tmp_path))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if os.fspath(p) == path
                        else real_access(p, mode, *a, **k))
    check_all_commands(path, words=("permission denied",))
    assert check_api(path, words=("permission denied",)) is False


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads every file")
def test_permission_denied_real(tmp_path):
    path = _copy("adam.h5", str(tmp_path))
    os.chmod(path, 0)
    try:
        check_all_commands(path, words=("permission denied",))
    finally:
        os.chmod(path, 0o644)


def test_absurd_shape_in_meta_allocates_nothing(tmp_path):
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        _set_meta(f, P, shape=[2 ** 62, 2 ** 62])
    check_all_commands(path, words=("fc1.weight",), measure_memory=True)


def test_dataset_too_large_to_read_in_one_block(tmp_path):
    """A declared shape no file this size can hold is refused before anything is read."""
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        f[REC_STEP].resize((BIG,))
    check_all_commands(path, words=("records/step",), measure_memory=True)


def test_lazy_read_errors_name_the_file(tmp_path):
    """Damage found only when it is read: ParamRecord.read, state_at and hparams raise RunFileError naming the file;
    caller errors (a bad row, a name that is no kind) stay IndexError/ValueError."""
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        _replace_dataset(f, P_GRAD, f[P_GRAD][()], chunks=(1, 20, 64), compression="gzip")
        chunk = f[P_GRAD].id.get_chunk_info_by_coord((3, 0, 0))
        f[REC_HPARAMS][4] = "{broken"
        f[f"{P}/state/exp_avg"].resize(3, axis=0)
    with open(path, "r+b") as f:  # garbage where grad row 3's compressed bytes were: inflate fails on read
        f.seek(chunk.byte_offset)
        f.write(b"\xa5" * chunk.size)
    with upd.open_run(path) as run:
        p = run.param("fc1.weight")
        assert p.read("grad", 2).shape == (20, 64)
        for call in (lambda: p.read("grad", 3), lambda: p.read("grad"), lambda: list(p.iter_blocks(["grad"])),
                     lambda: run.optimizers[0].hparams(4), lambda: p.state_at(10), run.ratios,
                     lambda: upd.verify(run)):
            with pytest.raises(upd.RunFileError) as exc:
                call()
            assert str(exc.value).startswith(path + ":") and "\n" not in str(exc.value)
        with pytest.raises(IndexError):
            p.read("grad", 99)
        with pytest.raises(ValueError):  # not a kind at all: a caller error
            p.read("nothing")
        with pytest.raises(IndexError):
            run.optimizers[0].hparams(99)
    check_all_commands(path, {"info": {0}, "analyze": {2}, "verify": {2}})


def _global_heap_collections(path: str) -> list[int]:
    """Byte offsets of HDF5 global heap collections ("GCOL"): where every variable-length string lives."""
    with open(path, "rb") as f:
        data = f.read()
    found, at = [], data.find(b"GCOL")
    while at >= 0:
        found.append(at)
        at = data.find(b"GCOL", at + 1)
    return found


@pytest.mark.parametrize("which", [0, -1])
def test_zeroed_global_heap_object_does_not_hang(tmp_path, which):
    """HDF5 itself loops forever, holding the GIL, on a global heap object of size 0: 16 zeroed bytes. The reader
    checks each collection before HDF5 parses it (found by the byte-flip property test)."""
    path = _copy("adam.h5", str(tmp_path))
    at = _global_heap_collections(path)[which]
    with open(path, "r+b") as f:
        f.seek(at + 16)  # the collection's first object header: index 0, size 0
        f.write(bytes(16))
    allowed = {"info": {0, 2}, "analyze": {0, 2}, "verify": {2}}  # the last collection may hold only hparams
    codes = check_all_commands(path, allowed if which == -1 else None, words=("global heap",))
    assert 2 in codes.values()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("where", ["root meta attribute", "hparams element"])
def test_corrupted_string_length_allocates_nothing(tmp_path, where):
    """HDF5 allocates (and zeroes) the length a stored string reference claims before reading the string: one
    corrupted 4-byte length is a 4 GiB allocation. The reader reads the stored references first and refuses
    (found by the byte-flip property test: 3 GB peak RSS, 1.5 s per command)."""
    import struct

    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r") as f:
        meta = f.attrs[schema.ATTR_META].encode()
        chunk = f[REC_HPARAMS].id.get_chunk_info_by_coord((0,))
    data = bytearray(open(path, "rb").read())
    if where == "root meta attribute":  # the reference (length, heap collection, index) in the root object header
        at = data.find(struct.pack("<IQ", len(meta), _global_heap_collections(path)[0]))
    else:  # the first element of records/hparams, in its chunk
        at = chunk.byte_offset
    assert at > 0
    data[at:at + 4] = struct.pack("<I", 0xF0000000)
    open(path, "wb").write(data)
    before = _peak_rss_mib()
    allowed = None if where == "root meta attribute" else {"info": {0}, "analyze": {0}, "verify": {2}}
    check_all_commands(path, allowed, words=("claims a string of 4026531840 bytes",))
    assert _peak_rss_mib() - before < 512


def test_compressed_chunk_with_corrupted_size_allocates_nothing(tmp_path):
    """A compressed chunk's stored size comes from the chunk index: a corrupted one claims 4 GiB. HDF5 checks it
    against the end of the file before allocating; the reader reports that in its one line."""
    import struct

    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        _replace_dataset(f, P_GRAD, f[P_GRAD][()], chunks=(1, 20, 64), compression="gzip")
        chunk = f[P_GRAD].id.get_chunk_info_by_coord((3, 0, 0))
    data = bytearray(open(path, "rb").read())
    # v1 B-tree key of that chunk: size (4), filter mask (4), offsets (3 + 1) x 8, then the chunk's address (8)
    key = struct.pack("<II4Q", chunk.size, 0, 3, 0, 0, 0) + struct.pack("<Q", chunk.byte_offset)
    at = data.find(key)
    assert at > 0
    data[at:at + 4] = struct.pack("<I", 0xF0000000)
    open(path, "wb").write(data)
    before = _peak_rss_mib()
    with upd.open_run(path) as run:
        p = run.param("fc1.weight")
        assert p.read("grad", 2).shape == (20, 64)
        with pytest.raises(upd.RunFileError, match="'grad' rows 3 of parameter 'fc1.weight'"):
            p.read("grad", 3)
    check_all_commands(path, {"info": {0}, "analyze": {2}, "verify": {2}}, words=("fc1.weight",))
    assert _peak_rss_mib() - before < 512


def test_flight_dumps_hostile(tmp_path):
    path = _copy("adam.h5", str(tmp_path))
    with h5py.File(path, "r+") as f:
        f[schema.FLIGHT_DUMPS] = np.arange(3)
    with upd.open_run(path) as run, pytest.raises(upd.RunFileError, match="flight_dumps"):
        run.dumps()
    with h5py.File(path, "r+") as f:
        del f[schema.FLIGHT_DUMPS]
        f.create_dataset(schema.FLIGHT_DUMPS, data=["[" * 10000, "{}"], dtype=h5py.string_dtype())
    with upd.open_run(path) as run, pytest.raises(upd.RunFileError, match="flight_dumps"):
        run.dumps()


@pytest.mark.slow
def test_real_subprocesses_one_line_exit_2(tmp_path):
    """`python -m upd` as a user runs it, under a 2 GiB address-space limit: one line on stderr, exit 2."""
    trunc = _copy("adam.h5", str(tmp_path))
    with open(trunc, "r+b") as f:
        f.truncate(100_000)
    absurd = tmp_path / "absurd.h5"
    shutil.copy(sample_path("sgd_momentum.h5"), absurd)
    with h5py.File(absurd, "r+") as f:
        f[REC_LR].resize(BIG, axis=1)
    newer = tmp_path / "newer.h5"
    shutil.copy(sample_path("adamw_onecycle_two_groups.h5"), newer)
    with h5py.File(newer, "r+") as f:
        f.attrs[schema.ATTR_VERSION] = 99

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    procs = [(cmd, path, subprocess.Popen([sys.executable, "-m", "upd", *cmd, str(path)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, preexec_fn=limit))
             for cmd, path in ((("info",), trunc), (("analyze", "--no-plots"), absurd), (("verify",), newer))]
    for cmd, path, proc in procs:
        out, err = proc.communicate(timeout=120)
        assert_one_line_error(cmd, path, proc.returncode, out, err)


def test_valid_samples_still_read():
    for name in SAMPLES:
        codes = check_all_commands(sample_path(name), {"info": {0}, "analyze": {0}, "verify": {0}})
        assert codes == {"info": 0, "analyze": 0, "verify": 0}


RSS_ABOVE_BASELINE_BYTES = 512 * 1024 * 1024  # per hostile-file test, above the process's RSS when it started
# The tests that build a hostile file deterministically (every structure and statistics-table mutation, the
# corrupted string lengths and chunk sizes, the absurd shapes): each must keep its process's peak RSS within
# RSS_ABOVE_BASELINE_BYTES of where it started. A peak RSS sees what tracemalloc cannot: allocations inside HDF5
# (a corrupted string length once made it touch 3 GB).
PEAK_MEASURED = ("each_structure_mutation", "statistics_table_mutations", "allocates_nothing", "too_large")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs "5"); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


PEAK_RESETTABLE = _reset_peak_rss()


@contextlib.contextmanager
def peak_rss_rise():
    """{"bytes": how far the peak RSS rose above the RSS at entry} once the block ends. The peak is reset at entry,
    so whatever the worker process ran before (a training run, a big fixture) does not hide a rise."""
    _reset_peak_rss()
    rise, start = {}, _status_bytes("VmRSS")
    yield rise
    rise["bytes"] = _status_bytes("VmHWM") - start


@pytest.fixture(autouse=True)
def _hostile_file_peak_rss_stays_bounded(request):
    if not PEAK_RESETTABLE or not any(key in request.node.name for key in PEAK_MEASURED):
        yield
        return
    with peak_rss_rise() as rise:
        yield
    assert rise["bytes"] <= RSS_ABOVE_BASELINE_BYTES, \
        f"peak RSS rose {rise['bytes'] / 2**20:.0f} MiB while reading this hostile file"


@pytest.mark.slow
@pytest.mark.skipif(not PEAK_RESETTABLE, reason="the peak RSS cannot be reset here (no /proc/self/clear_refs)")
def test_peak_rss_rise_sees_memory_allocated_inside_c_code():
    """The per-test bound above can fail: memory that C code (here libc's malloc, as HDF5 would) touches and frees
    again inside the block is seen, and memory touched before the block is not."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    size = RSS_ABOVE_BASELINE_BYTES + 128 * 2**20
    before = libc.malloc(size)
    ctypes.memset(before, 1, size)
    libc.free(ctypes.c_void_p(before))
    with peak_rss_rise() as quiet:
        pass
    assert quiet["bytes"] < 64 * 2**20  # the allocation before the block left the peak high: the reset hid it
    with peak_rss_rise() as rise:
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(ctypes.c_void_p(block))
    assert rise["bytes"] > RSS_ABOVE_BASELINE_BYTES


def test_the_peak_rss_bound_covers_the_hostile_file_tests(request):
    """The names in PEAK_MEASURED still select the hostile-file tests (more than 100 of them)."""
    names = [item.name for item in request.session.items if item.fspath == request.node.fspath]
    assert sum(any(key in name for key in PEAK_MEASURED) for name in names) > 100 or \
        len(names) < 100  # run with -k or one test: the session does not hold the module's tests


# Where the peak cannot be reset in process: pytest on the same tests in a fresh interpreter, printing as JSON its
# peak RSS once the tests are collected (torch, h5py, upd and this module imported) and after each test. VmHWM, not
# ru_maxrss: on Linux a child's ru_maxrss starts at its parent's RSS when it was forked.
PEAK_RSS_CHILD = textwrap.dedent("""
    import json, resource, sys
    import pytest

    def peak_rss_bytes():
        try:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):  # no procfs: ru_maxrss (bytes on macOS, KiB elsewhere)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

    class PeakRss:
        def __init__(self):
            self.baseline, self.after = None, {}

        def pytest_collection_finish(self, session):
            self.baseline = peak_rss_bytes()

        def pytest_runtest_logfinish(self, nodeid, location):
            self.after[nodeid] = peak_rss_bytes()

    peak = PeakRss()
    code = pytest.main(sys.argv[1:], plugins=[peak])
    print(json.dumps({"exit": int(code), "baseline": peak.baseline, "after": peak.after}))
""")


@pytest.mark.slow
@pytest.mark.skipif(PEAK_RESETTABLE, reason="each hostile-file test bounds its own peak RSS in process (above)")
def test_peak_memory_of_the_hostile_file_tests_stays_bounded():
    """Where the peak RSS cannot be reset in process, the same bound measured in a fresh process."""
    selection = " or ".join(PEAK_MEASURED)
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS_CHILD, __file__, "-q", "-p", "no:cacheprovider", "-k",
                           selection], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    last_line = (proc.stdout.strip().splitlines() or [""])[-1]
    assert last_line.startswith("{"), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(last_line)
    assert len(report["after"]) > 100, proc.stdout[-3000:]  # the selection still finds the hostile-file tests
    rise = {test: peak - report["baseline"] for test, peak in report["after"].items()}
    over = {test: f"{r / 2**20:.0f} MiB" for test, r in rise.items() if r > RSS_ABOVE_BASELINE_BYTES}
    assert not over, over  # the first one listed raised the high-water mark; later ones only kept it
    assert report["exit"] == 0, proc.stdout[-3000:]
