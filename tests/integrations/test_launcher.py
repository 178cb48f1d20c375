"""`upd record RUN -- COMMAND`: real training programs that never import upd, recorded from outside, and the runs
they leave verified.

The programs are tests/harness/scripts/ (plain scripts, as a user writes them). Each recorded run is verified (exit
code 0; with the `upd verify` command for the recipe and the torchrun job, through upd.verify, which the command
shows, elsewhere), and the names it holds are the model's own; the plain script's output and exit status are
compared with the recorded one's.
"""
import contextlib
import importlib.util
import io
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time

import h5py
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import upd
from upd.cli.main import main
from upd.launcher import attach, env
from upd.runfile import schema

from tests.harness.paths import REPO_ROOT
from tests.harness.scripts import script

MLP_NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
SEQUENTIAL_NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def upd_record(options, command, cwd, **popen):
    """`upd record` as a user runs it: a process of its own (it execs the command), in `cwd`."""
    return subprocess.run([sys.executable, "-m", "upd", "record", *options, "--", *command], cwd=cwd,
                          capture_output=True, text=True, timeout=300, **popen)


def python(name, *args):
    return [sys.executable, script(name), *args]


def run_plain(name, *args) -> tuple:
    """`python SCRIPT ARGS` without upd, run in this process (torch is imported already, a child would import it
    again): (exit status, stdout, stderr). The script's global settings (threads, seed, argv) are restored after."""
    out, err = io.StringIO(), io.StringIO()
    argv, threads, status = sys.argv, torch.get_num_threads(), 0
    sys.argv = [script(name), *args]
    try:
        with torch.random.fork_rng(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script(name), run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    return status, out.getvalue(), err.getvalue()


def verify_cli(path):
    """`upd verify RUN`: the command itself, in this process (tests/cli runs `upd` as a process of its own)."""
    return CliRunner().invoke(main, ["verify", str(path)])


def param_names(path, optimizer=0) -> list:
    with upd.open_run(str(path)) as run:
        params = run.params()
        return list(params[params["optimizer"] == optimizer]["param"])


def closed_cleanly(path) -> bool:
    with h5py.File(path, "r") as f:
        return bool(f.attrs.get(schema.ATTR_CLOSED_CLEANLY, False))


def launcher_recipe() -> list:
    """The launcher's command line in docs/integrations.md, as its words (the docs promise that these tests run
    it)."""
    with open(os.path.join(REPO_ROOT, "docs", "integrations.md")) as f:
        lines = [line for line in f.read().splitlines() if line.startswith("upd record ")]
    assert len(lines) == 1, lines
    return lines[0].split()


# -- real programs, recorded ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_recipe_records_a_script_that_never_imports_upd(tmp_path):
    """The documented command line on a plain script: same output and exit status as without upd, a run named
    after the script's model that verifies, and verify fails once a recorded update is changed."""
    words = launcher_recipe()  # upd record runs/lm.h5 --every 50 --stats-every 1 -- python train.py --lr 1e-3
    at = words.index("--")
    options, script_args = words[2:at], words[at + 3:]
    assert words[at + 1] == "python" and "--lr" in script_args
    plain = run_plain("train_mlp.py", *script_args)
    recorded = upd_record(options, python("train_mlp.py", *script_args), tmp_path)
    assert (recorded.returncode, recorded.stdout, recorded.stderr) == plain
    assert plain[0] == 0 and plain[1].startswith("final loss")

    path = tmp_path / options[0]
    assert param_names(path) == MLP_NAMES
    with upd.open_run(str(path)) as run:
        steps = run.steps()
        assert list(steps["step"]) == list(range(6))  # --stats-every 1
        assert run.param("fc1.weight").num_rows == 1  # --every 50 over 6 steps: one full record
        assert steps["backward_pass"].iloc[0] == 1  # counted from before the recorder attached
        assert sorted(run.stats()["step"].unique()) == list(range(6))
        assert float(steps.filter(like="lr").iloc[0, 0]) == pytest.approx(1e-3)
    assert closed_cleanly(path)
    result = verify_cli(path)
    assert result.exit_code == 0, result.output
    with h5py.File(path, "r+") as f:
        after = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name="fc1.weight")]
        after[0] = after[0] * 1.001
    assert upd.verify(str(path)).exit_code == 1


@pytest.mark.slow
def test_a_script_that_compiles_replaces_its_optimizer_and_exits_3(tmp_path):
    """Exit status 3 passes through; torch.compile's prefix is not in the names; the optimizer made at step 3 goes
    into the run's second part; both parts are closed and verify."""
    result = upd_record(["run.h5", "--every", "1"],
                        python("train_mlp.py", "--compile", "--restart-at", "3", "--exit-code", "3"),
                        tmp_path)
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith("final loss") and "RecorderWarning" not in result.stderr
    first, second = tmp_path / "run.h5", tmp_path / "run.part2.h5"
    assert sorted(os.listdir(tmp_path)) == ["run.h5", "run.part2.h5"]
    for path, optimizer in ((first, "torch.optim.Adam"), (second, "torch.optim.SGD")):
        assert param_names(path) == MLP_NAMES
        with upd.open_run(str(path)) as run:
            assert run.optimizers[0].class_name == optimizer
            assert list(run.steps()["step"]) == [0, 1, 2]
        assert closed_cleanly(path)
        report = upd.verify(str(path))
        assert report.exit_code == 0 and report.matched == 12, report.summary()


@pytest.mark.slow
def test_two_optimizers_are_both_in_the_run(tmp_path):
    """A GAN's generator and discriminator optimizers, named after their own models; --overwrite first removes
    every file of the earlier run at that path."""
    (tmp_path / "gan.h5").write_bytes(b"an earlier run")
    (tmp_path / "gan.part2.h5").write_bytes(b"its second part")
    (tmp_path / "gan-notes.txt").write_text("not the run's")
    result = upd_record(["gan.h5", "--every", "1", "--overwrite"], python("train_gan.py"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["gan-notes.txt", "gan.h5"]
    path = tmp_path / "gan.h5"
    with upd.open_run(str(path)) as run:
        assert [opt.class_name for opt in run.optimizers] == ["torch.optim.Adam", "torch.optim.SGD"]
        assert [len(opt.steps) for opt in run.optimizers] == [4, 4]
    assert param_names(path, 0) == param_names(path, 1) == SEQUENTIAL_NAMES
    report = upd.verify(str(path))
    assert report.exit_code == 0 and report.matched == 32, report.summary()


@pytest.mark.slow
def test_sigterm_to_the_launcher_closes_the_run(tmp_path):
    """`upd record` is the program (it execs): SIGTERM ends it as it would end the script, and the run it leaves
    is closed cleanly and verifies."""
    proc = subprocess.Popen([sys.executable, "-m", "upd", "record", "run.h5", "--", *python("train_mlp.py",
                             "--until-signal")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM, proc.stderr.read()
    path = tmp_path / "run.h5"
    assert closed_cleanly(path)
    with upd.open_run(str(path)) as run:
        assert len(run.steps()) >= 5
    report = upd.verify(str(path))
    assert report.exit_code == 0 and report.mismatched == 0, report.summary()


@pytest.mark.slow
def test_torchrun_ddp_job_records_one_file_per_rank(tmp_path):
    """`torchrun --nproc_per_node 2` of a DDP script on gloo, every rank recording (--ranks all): one file per rank,
    names without DDP's `module.`, and `upd verify` reads the job (replicas compared)."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    launch = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command = [*launch, "--standalone", "--nproc_per_node", "2", script("train_ddp.py")]
    result = upd_record(["ddp.h5", "--every", "1", "--ranks", "all"], command, tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r"rank \d", result.stdout)) == ["rank 0", "rank 1"]
    assert sorted(os.listdir(tmp_path)) == ["ddp.rank0-of-2.h5", "ddp.rank1-of-2.h5"]
    with upd.open_run(str(tmp_path / "ddp.h5")) as job:
        assert job.world_size == 2 and sorted(job.ranks) == [0, 1]
        assert list(job.params()["param"]) == SEQUENTIAL_NAMES
        assert list(job.steps()["step"]) == [0, 1, 2, 3]
    checked = verify_cli(tmp_path / "ddp.h5")
    assert checked.exit_code == 0, checked.output
    assert "replicas compared" in checked.output


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_one_process_deepspeed_records_both_param_groups_with_the_models_shapes(tmp_path):
    """`torchrun --nproc_per_node 1` of a DeepSpeed ZeRO-2 script with two param groups (the one-GPU fine-tune): the
    launcher attaches at the first step, inside DeepSpeed's step of one group (ZeRO-1/2 show their optimizer one
    group at a time), and still records both groups, every parameter with the model's name and shape, equal to the
    same training in plain torch (tests/distributed/test_deepspeed.py's reference and tolerance), without warning;
    `upd analyze` judges its weights."""
    sys.path.insert(0, os.path.dirname(script("train_deepspeed.py")))
    import train_deepspeed as ds_job

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               script("train_deepspeed_plain.py")]
    result = upd_record(["ds.h5", "--every", "1", "--stats-every", "1"], command, tmp_path,
                        env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RecorderWarning" not in result.stderr, result.stderr[-4000:]
    reference = str(tmp_path / "reference.h5")
    ds_job.reference("adamw", reference, every=1, stats_every=1)
    expected = [(n, tuple(p.shape)) for n, p in ds_job.Block().named_parameters()]
    with upd.open_run(str(tmp_path / "ds.h5")) as run, upd.open_run(reference) as ref:
        table = run.params()
        assert sorted(zip(table["param"], table["shape"])) == sorted(expected)
        opt, ref_opt = run.optimizers[0], ref.optimizers[0]
        assert opt.num_param_groups == 2 and opt.num_records == ds_job.STEPS
        for name, _ in expected:
            assert opt.param_records[name].param_group == ref_opt.param_records[name].param_group, name
            for kind in (schema.KIND_PARAM, schema.KIND_GRAD, schema.KIND_PARAM_AFTER):
                torch.testing.assert_close(opt.param_records[name].read(kind), ref_opt.param_records[name].read(kind),
                                           atol=1e-6, rtol=0, msg=f"{name} {kind}")
        assert [g["weight_decay"] for g in opt.hparams(0)][:2] == [0.1, 0.0]
    analyzed = CliRunner().invoke(main, ["analyze", str(tmp_path / "ds.h5"), "--no-plots"])
    assert analyzed.exit_code == 0, analyzed.output
    assert "nothing to judge" not in analyzed.output, analyzed.output
    rows = {}  # each parameter's row of the table: its first line that starts with its name
    for line in analyzed.output.splitlines():
        rows.setdefault(line.split()[0] if line.split() else "", line)
    for name, shape in expected:  # the weights are judged, the rest are not weights
        assert ("not a weight" in rows[name]) == (len(shape) < 2), rows[name]
    assert verify_cli(tmp_path / "ds.h5").exit_code == 0


@pytest.mark.slow
def test_spawned_workers_each_take_a_part_and_the_parent_that_never_trains_none(tmp_path):
    """torch.multiprocessing.spawn workers without a process group: the hooks reach both, each records into its own
    part of the run (RUN, RUN.part2), and the parent, which imports torch but never makes an optimizer, writes
    nothing. The user's own sitecustomize.py, which the launcher's bootstrap hides on PYTHONPATH, still runs in
    each of the three processes; output and exit status are the script's."""
    own, ran, work = tmp_path / "own_site", tmp_path / "own_site_ran", tmp_path / "work"
    for folder in (own, ran, work):
        folder.mkdir()
    # Each process the command started leaves its sys.argv (`upd record` itself, before it execs, is left out: it
    # has no request in its environment yet).
    (own / "sitecustomize.py").write_text(
        f"import os, sys\nif {env.ENV_VAR!r} in os.environ:\n"
        f"    open(os.path.join({str(ran)!r}, str(os.getpid())), 'w').write(repr(sys.argv))\n")
    result = upd_record(["sweep.h5", "--every", "1"], python("train_workers.py"), work,
                        env={**os.environ, "PYTHONPATH": str(own)})
    assert (result.returncode, result.stdout, result.stderr) == (0, "workers done\n", "")
    assert sorted(os.listdir(work)) == ["sweep.h5", "sweep.part2.h5"]
    argvs = [(ran / pid).read_text() for pid in os.listdir(ran)]
    assert len([a for a in argvs if "train_workers.py" in a]) == 1, argvs  # the script
    assert len([a for a in argvs if "--multiprocessing-fork" in a]) == 2, argvs  # its workers
    learning_rates = set()
    for name in ("sweep.h5", "sweep.part2.h5"):
        assert param_names(work / name) == ["weight", "bias"]
        with upd.open_run(str(work / name)) as run:
            assert list(run.steps()["step"]) == [0, 1, 2]
            learning_rates.add(round(float(run.optimizers[0].learning_rates[0, 0]), 6))
        report = upd.verify(str(work / name))
        assert report.exit_code == 0 and report.matched == 6, report.summary()
    assert learning_rates == {0.1, 0.2}  # one run per worker, not one worker twice


# -- the command line, before anything starts --------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["run.h5", "--every", "0", "--", "python", "x.py"], "--every"),
    (["run.h5", "--dtype", "float64", "--", "python", "x.py"], "--dtype"),
    (["run.h5", "--ranks", "some", "--", "python", "x.py"], "--ranks"),
    (["run.h5", "--spike-factor", "1", "--", "python", "x.py"], "spike_factor"),
    (["run.h5", "--every", "never", "--", "python", "x.py"], "record nothing"),
    (["run.h5", "--overwrite", "--resume", "--", "python", "x.py"], "not both"),
    (["run.h5"], "put it after --"),
    (["run.h5", "python", "x.py"], "the command goes after --"),
    (["run.h5", "--lr", "1e-3", "--", "python", "x.py"], "--lr"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words):
    result = CliRunner().invoke(main, ["record", *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("upd: error: ") and result.output.count("\n") == 1, result.output
    assert words in result.output
    assert os.listdir(tmp_path) == []


def test_the_launcher_checks_options_without_importing_torch():
    """`upd record` refuses a bad option with the recorder's own message before it starts the command, in a process
    that has not imported torch (seconds here; the command imports it again anyway); the control is a Recorder."""
    code = ("import sys; from upd.cli.record import check_options\n"
            "try:\n    check_options({'every': None, 'stats_every': None, 'tensorboard': None})\n"
            "except SystemExit as exit:\n    print(exit.code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert "would record nothing" in done.stderr
    with pytest.raises(ValueError, match="would record nothing"):
        upd.record(os.devnull, None, None, every=None, stats_every=None)


def test_an_existing_run_is_refused_and_a_missing_command_is_127(tmp_path):
    existing = tmp_path / "run.rank1-of-2.h5"
    existing.write_bytes(b"an earlier job's file")
    result = CliRunner().invoke(main, ["record", str(tmp_path / "run.h5"), "--", sys.executable, "-c", "pass"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "--overwrite" in result.output
    assert existing.read_bytes() == b"an earlier job's file"
    result = CliRunner().invoke(main, ["record", str(tmp_path / "new.h5"), "--", str(tmp_path / "no-such-program")])
    assert result.exit_code == 127 and "command not found" in result.output and result.output.count("\n") == 1


def test_help_explains_the_launcher():
    result = CliRunner().invoke(main, ["record", "--help"])
    assert result.exit_code == 0
    for words in ("-- COMMAND", "PYTHONPATH", "sitecustomize", "torchrun", "UPD_RECORD", "Exit codes", "127",
                  "named_parameters", "--stats-every", "docs/launcher.md"):
        assert words in result.output, words


# -- the pieces, in this process ---------------------------------------------------------------------------------
def test_run_files_are_the_run_its_parts_and_their_rank_files(tmp_path):
    run = str(tmp_path / "lm.h5")
    assert env.part_path(run, 1) == run and env.part_path(run, 3) == str(tmp_path / "lm.part3.h5")
    ours = ["lm.h5", "lm.part2.h5", "lm.rank0-of-2.h5", "lm.part2.rank1-of-2.h5"]
    others = ["lm2.h5", "lm.h5.bak", "lm.partx.h5", "lmx.rank0-of-2.h5", "notes.txt"]
    for name in ours + others:
        (tmp_path / name).write_bytes(b"")
    assert sorted(map(os.path.basename, env.run_files(run))) == sorted(ours)


def test_child_environment_puts_the_bootstrap_first_and_the_request_in_the_variable():
    environ = env.child_environment("runs/x.h5", {"every": 5}, {"PYTHONPATH": "/a" + os.pathsep + "/b"})
    assert environ["PYTHONPATH"].split(os.pathsep) == [env.BOOTSTRAP_DIR, "/a", "/b"]
    assert os.path.isfile(os.path.join(env.BOOTSTRAP_DIR, "sitecustomize.py"))
    assert env.decode(environ[env.ENV_VAR]) == (os.path.abspath("runs/x.h5"), {"every": 5})
    with pytest.raises(ValueError):
        env.decode('{"version": 0}')


def test_the_owning_model_is_found_among_the_live_modules():
    """Names come from the module that owns the optimizer's parameters: the whole model when the optimizer steps
    part of it, each model of a GAN for its optimizer, through DataParallel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    head_only = torch.optim.SGD(model[1].parameters(), lr=0.1)
    assert attach.owning_model([head_only]) is model  # not model[1]: names as model.named_parameters()
    wrapped = nn.DataParallel(model)
    assert attach.owning_model([head_only]) is model
    del wrapped
    other = nn.Linear(2, 2)
    pair = attach.owning_model([head_only, torch.optim.SGD(other.parameters(), lr=0.1)])
    assert isinstance(pair, attach.Models)
    assert [n for n, _ in pair.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias", "weight", "bias"]
    assert attach.owning_model([torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)]) is None


@pytest.mark.slow  # importing lightning
def test_the_owning_model_is_found_through_lightning_fabrics_wrapper():
    fabric = pytest.importorskip("lightning.fabric.wrappers")
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    wrapped = fabric._FabricModule(model, None)  # what Fabric's setup() returns: names with `_forward_module.`
    assert next(iter(wrapped.named_parameters()))[0].startswith("_forward_module.")
    assert attach.owning_model([torch.optim.SGD(wrapped.parameters(), lr=0.1)]) is model
