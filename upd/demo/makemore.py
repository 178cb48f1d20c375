"""A makemore (part 3) style character-level MLP on names, trained with SGD and recorded with torch-upd.

After Andrej Karpathy's "Building makemore Part 3: Activations & Gradients, BatchNorm": three characters of
context are embedded, passed through a stack of Linear -> BatchNorm1d -> Tanh layers and mapped to 27 logits.

Two initializations show what the update:data ratio is for:

* ``init="good"``: the video's Kaiming init (gain 5/3 over sqrt(fan_in)), and the last BatchNorm's gain scaled
  down to 0.1 so the first loss is close to -log(1/27) = 3.30. With lr 0.1 the weights' update:data ratios sit
  near 1e-3 (log10 about -3), the video's rule of thumb.
* ``init="bad"``: the hidden weights drawn as ``0.01 * randn``, the "small random numbers" recipe of the CS231n
  notes. BatchNorm renormalizes each layer's output, so the forward pass and the loss look fine (in a run this
  short the loss even ends a little lower). But a weight feeding a BatchNorm gets a gradient that scales with
  1/scale, so its update:data ratio scales with 1/scale**2: the hidden weights change by several percent per step
  (log10 about -1.3) instead of 0.1%, and their initialization is gone within a few steps. BatchNorm hides a bad
  weight scale from the forward pass, but not from the update:data ratio. (Such updates also grow the weights,
  which slowly pulls the ratio down: in much longer runs it ends lower.)
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import upd
from upd.torch_threads import one_torch_thread

BLOCK_SIZE = 3  # characters of context
CHARS = "." + "abcdefghijklmnopqrstuvwxyz"  # '.' starts and ends every name
VOCAB_SIZE = len(CHARS)
STOI = {ch: i for i, ch in enumerate(CHARS)}
INITS = ("good", "bad")


def load_words() -> list[str]:
    """The names shipped with the package, one per line."""
    return (Path(__file__).parent / "names.txt").read_text().split()


def build_dataset(words: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, Y): every BLOCK_SIZE-character context in the words and the character that follows it."""
    xs, ys = [], []
    for word in words:
        context = [0] * BLOCK_SIZE
        for ch in word + ".":
            ix = STOI[ch]
            xs.append(context)
            ys.append(ix)
            context = context[1:] + [ix]
    return torch.tensor(xs), torch.tensor(ys)


class MLP(nn.Module):
    def __init__(self, n_embd: int = 10, n_hidden: int = 48, n_layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB_SIZE, n_embd)
        layers, fan_in = [], n_embd * BLOCK_SIZE
        for _ in range(n_layers):
            # No bias: the BatchNorm right after subtracts the mean, so a bias would get no gradient.
            layers += [nn.Linear(fan_in, n_hidden, bias=False), nn.BatchNorm1d(n_hidden), nn.Tanh()]
            fan_in = n_hidden
        # As in the video the logits get a BatchNorm too: its gain, not the weights, then sets how confident the
        # first predictions are, so the output weights keep a normal scale and a normal update:data ratio.
        layers += [nn.Linear(fan_in, VOCAB_SIZE, bias=False), nn.BatchNorm1d(VOCAB_SIZE)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.emb(x).flatten(1))


@torch.no_grad()
def init_weights(model: MLP, init: str) -> None:
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    nn.init.normal_(model.emb.weight)  # the video's C = randn(27, n_embd)
    *hidden, out = [m for m in model.layers if isinstance(m, nn.Linear)]
    for lin in hidden:
        if init == "good":
            # tanh squashes its input; 5/3 is the gain that keeps activations from shrinking layer by layer.
            lin.weight.normal_(0.0, (5 / 3) / lin.in_features ** 0.5)
        else:
            lin.weight.normal_(0.0, 0.01)
    out.weight.normal_(0.0, 1 / out.in_features ** 0.5)
    # Logits close to 0 make the first prediction near-uniform, a first loss near log(27) = 3.30 rather than a
    # "hockey stick" spent unlearning confident wrong guesses. Both inits share this, so their losses start alike.
    model.layers[-1].weight.fill_(0.1)


@torch.no_grad()
def split_loss(model: MLP, X: torch.Tensor, Y: torch.Tensor) -> float:
    """Cross-entropy over a whole split in eval mode, BatchNorm using its running statistics."""
    was_training = model.training
    model.eval()
    try:
        return F.cross_entropy(model(X), Y).item()
    finally:
        model.train(was_training)


DEFAULT_STEPS = 300


def train(path, *, steps: int = DEFAULT_STEPS, init: str = "good", seed: int = 0, batch_size: int = 32, lr: float = 0.1,
          every: int = 1, n_hidden: int = 48, n_layers: int = 4, log=print, progress=None) -> dict:
    """Train the MLP on the shipped names with SGD, recording every ``every``-th step to the run file ``path``.

    The learning rate drops from ``lr`` to ``lr / 10`` for the last quarter of the steps (as in the video), so the
    recorded ratios also show what a learning-rate decay does. Deterministic for a given ``seed``. ``progress``:
    called as ``progress(steps_done, steps)`` after each step (a progress bar).

    Returns a dict: path, init, seed, steps, records, train_loss_start (the first minibatch's loss), final_loss and
    val_loss (whole train / held-out split after training), losses (every minibatch loss), seconds.
    """
    started = time.perf_counter()
    with one_torch_thread():
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        words = load_words()
        perm = torch.randperm(len(words), generator=gen).tolist()
        words = [words[i] for i in perm]
        n_train = int(0.9 * len(words))
        Xtr, Ytr = build_dataset(words[:n_train])
        Xval, Yval = build_dataset(words[n_train:])

        model = MLP(n_hidden=n_hidden, n_layers=n_layers)
        init_weights(model, init)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[steps * 3 // 4], gamma=0.1)

        losses = []
        with upd.record(path, model, optimizer, every=every, overwrite=True) as rec:
            for i in range(steps):
                ix = torch.randint(0, Xtr.shape[0], (batch_size,), generator=gen)
                loss = F.cross_entropy(model(Xtr[ix]), Ytr[ix])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                rec.log(loss=loss)  # drawn under the ratios by upd analyze
                optimizer.step()
                losses.append(loss.item())
                if log is not None and (i % max(1, steps // 10) == 0 or i == steps - 1):
                    log(f"{i:5d}/{steps}: loss {losses[-1]:.4f}  lr {optimizer.param_groups[0]['lr']:g}")
                if progress is not None:
                    progress(i + 1, steps)
                scheduler.step()
            records = rec.records

        return {"path": str(path), "init": init, "seed": seed, "steps": steps, "records": records,
                "train_loss_start": losses[0], "final_loss": split_loss(model, Xtr, Ytr),
                "val_loss": split_loss(model, Xval, Yval), "losses": losses,
                "seconds": time.perf_counter() - started}
