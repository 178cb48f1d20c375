"""The recipes of docs/integrations.md run as written, on tiny models, and each records a run that verifies and
holds the steps and the loss it trained with.

A recipe's python block uses `build_model()`, `loader` and `loss_fn` (and, for the Trainers, `model` and
`train_dataset`) as stand-ins for the user's own; the tests provide tiny ones and run the block unchanged. Every
section of the document has a block run here, or a marker comment saying which tests run it instead.
"""
import json
import os
import re

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema

from tests.harness.distributed import torchrun_script
from tests.harness.paths import REPO_ROOT

DOC = os.path.join(REPO_ROOT, "docs", "integrations.md")
SKIP_MARKER = "<!-- test_recipes: not run here"
BATCHES = 10  # in `loader`: one optimizer step each


def sections() -> dict:
    """{section title: its text} for every "## " section of the document."""
    with open(DOC) as f:
        parts = re.split(r"^## ", f.read(), flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def recipe(title: str) -> str:
    """The one python block of a section."""
    blocks = re.findall(r"```python\n(.*?)```", sections()[title], re.S)
    assert len(blocks) == 1, f"section {title!r} has {len(blocks)} python blocks"
    return blocks[0]


class RecordingLoss:
    """An MSE loss function that keeps each value it returned, to compare with the run's loss column."""

    def __init__(self):
        self.values = []

    def __call__(self, output, target):
        loss = nn.functional.mse_loss(output, target)
        self.values.append(loss.item())
        return loss


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def make_loader():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8 * BATCHES, 6, generator=g), torch.randn(8 * BATCHES, 3, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def run_recipe(title: str, folder, **names) -> dict:
    """Run a section's block in `folder` with the stand-ins (and `names`) defined; returns its namespace."""
    namespace = {"build_model": build_model, "loader": make_loader(), "loss_fn": RecordingLoss(), **names}
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(recipe(title), f"{DOC}: {title}", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def check_recorded(path, steps: int, every: int, losses=None,
                   names=("0.weight", "0.bias", "2.weight", "2.bias")) -> None:
    """What a recipe's run must hold: statistics of all `steps` steps and full records of every `every`-th, each
    preceded by one backward pass per step; every full record verified; the parameters under the model's own names;
    and the loss the training computed at each step (when the recipe logs one)."""
    report = upd.verify(path)
    assert report.exit_code == 0, report.summary()
    with upd.open_run(path) as run:
        table = run.steps()
        records = table.dropna(subset=["record"])
        assert list(records["step"]) == list(range(0, steps, every))
        assert list(records["backward_pass"]) == [step + 1 for step in records["step"]]
        assert report.matched == len(records) * len(names)
        assert sorted(set(run.stats()["step"])) == list(range(steps))
        assert list(run.optimizers[0].param_records) == list(names)
        if losses is not None:
            assert list(table["step"]) == list(range(steps))
            assert np.allclose(table[schema.SCALAR_LOSS].astype(float), losses, rtol=1e-6)


def test_every_section_has_a_recipe_run_here_or_says_which_tests_run_it():
    run_here = {"A plain training loop", "Mixed precision: torch.amp and GradScaler", "Hugging Face Trainer", "Lightning", "Accelerate", "torchrun and DDP",
                "torch.compile", "Weights & Biases", "MLflow"}  # these two: in test_trackers.py, with the trackers
    found = sections()
    for title, text in found.items():
        if title in run_here:
            recipe(title)
            assert SKIP_MARKER not in text
        else:
            assert SKIP_MARKER in text and "```python" not in text, title
    assert run_here < set(found)
    launcher = found["Without editing the script: the launcher"]
    assert "upd record runs/" in launcher and "(launcher.md)" in launcher


def test_the_documents_links_lead_to_files_of_the_repository():
    with open(DOC) as f:
        targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", f.read())
    assert "launcher.md" in targets and "../README.md" in targets
    for target in targets:
        assert os.path.isfile(os.path.join(os.path.dirname(DOC), target)), target


def test_plain_training_loop(tmp_path):
    namespace = run_recipe("A plain training loop", tmp_path)
    check_recorded(tmp_path / "runs" / "exp1.h5", BATCHES, 5, namespace["loss_fn"].values)


@pytest.mark.slow
def test_mixed_precision(tmp_path):
    namespace = run_recipe("Mixed precision: torch.amp and GradScaler", tmp_path)
    path = tmp_path / "runs" / "amp.h5"
    check_recorded(path, BATCHES, 5, namespace["loss_fn"].values)
    with upd.open_run(path) as run:
        steps = run.steps()
        # unscale_ ran first: the fused step got unscaled gradients (scale 1) and found no inf
        assert (steps[schema.SCALAR_AMP_GRAD_SCALE] == 1).all() and (steps[schema.SCALAR_AMP_FOUND_INF] == 0).all()


def test_the_check_fails_on_a_wrong_loss_and_a_changed_update(tmp_path):
    namespace = run_recipe("A plain training loop", tmp_path)
    path, losses = tmp_path / "runs" / "exp1.h5", namespace["loss_fn"].values
    with pytest.raises(AssertionError):
        check_recorded(path, BATCHES, 5, [loss * 1.001 for loss in losses])
    with pytest.raises(AssertionError):
        check_recorded(path, BATCHES, 2, losses)
    with h5py.File(path, "r+") as f:
        after = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name="2.weight")]
        after[0] = after[0] * 1.001
    with pytest.raises(AssertionError, match="mismatch"):
        check_recorded(path, BATCHES, 5, losses)


def tiny_gpt2():
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
def test_hugging_face_trainer(tmp_path):
    tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    namespace = run_recipe("Hugging Face Trainer", tmp_path, model=tiny_gpt2(),
                           train_dataset=[{"input_ids": t, "labels": t} for t in tokens])
    trainer = namespace["trainer"]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    path = tmp_path / "out" / "upd-run.h5"
    with upd.open_run(path) as run:
        names = list(run.optimizers[0].param_records)
    assert names[0] == "transformer.wte.weight" and len(losses) == 8
    check_recorded(path, 8, 2, losses, names=names)


@pytest.mark.slow
def test_lightning(tmp_path):
    import lightning.pytorch as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model()
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Regression()
    namespace = run_recipe("Lightning", tmp_path, model=module)
    path = os.path.join(namespace["trainer"].log_dir, "upd-run.h5")
    assert path.startswith(str(tmp_path))
    check_recorded(path, 8, 2, module.losses, names=("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"))


def test_accelerate(tmp_path):
    import accelerate

    try:
        namespace = run_recipe("Accelerate", tmp_path)
        assert type(namespace["optimizer"]).__name__ == "AcceleratedOptimizer"
        check_recorded(tmp_path / "runs" / "accelerate.h5", BATCHES, 5, namespace["loss_fn"].values)
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


# Defines the stand-ins in the torchrun recipe's script; each rank writes the losses it computed at exit.
TORCHRUN_PRELUDE = '''
import atexit, json, os
from tests.integrations.test_recipes import RecordingLoss, build_model, make_loader
loader, loss_fn = make_loader(), RecordingLoss()
atexit.register(lambda: json.dump(loss_fn.values, open(f"losses.rank{os.environ['RANK']}.json", "w")))
'''


@pytest.mark.slow
def test_torchrun_and_ddp(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_PRELUDE + recipe("torchrun and DDP"))
    done = torchrun_script(str(script), cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RecorderWarning" not in done.stderr
    assert os.listdir(tmp_path / "runs") == ["ddp.h5"]  # rank 0 alone, into the path itself
    with open(tmp_path / "losses.rank0.json") as f:
        losses = json.load(f)
    check_recorded(tmp_path / "runs" / "ddp.h5", BATCHES, 5, losses)
    with upd.open_run(tmp_path / "runs" / "ddp.h5") as run:
        assert run.meta[schema.META_DISTRIBUTED]["parallelism"] == schema.DDP


@pytest.mark.slow
def test_torch_compile(tmp_path, monkeypatch):
    """The recipe as written, compiled with aot_eager: what it checks (dynamo tracing, the names) does not depend on
    the backend, and inductor's C++ builds (about 25 s on a fresh cache) are tested once, in
    tests/recorder/test_compile.py."""
    torch._dynamo.reset()
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_with(*args, backend="aot_eager", **kwargs))
    namespace = run_recipe("torch.compile", tmp_path)
    assert type(namespace["model"]).__name__ == "OptimizedModule"
    check_recorded(tmp_path / "runs" / "compiled.h5", BATCHES, 5)  # names without "_orig_mod."
