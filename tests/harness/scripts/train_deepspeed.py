"""A DeepSpeed job on the CPU (DS_ACCELERATOR=cpu, gloo), recorded by upd.record on every rank: run through torchrun
on 2 ranks by tests/distributed/test_deepspeed.py. ``train_deepspeed.py OUT CONFIG...``: each CONFIG is
``<stage>-<optimizer>`` (``2-adamw``, ``1-sgd``; ``2-offload``: AdamW with the optimizer offloaded to the CPU,
which torch-upd refuses) and its job records to OUT/<config>.h5 (rank files); rank 0 writes the model's names and
shapes to OUT/<config>.names.json, every warning upd.record gave (the category's name and the message) to
OUT/<config>.warnings.json and what its live sink got (``Collect``) to OUT/<config>.sink.json. CONFIG ``hf``: the
Hugging Face Trainer with a DeepSpeed config and UpdCallback (``run_trainer``).

The model is a small transformer-like block whose parameter sizes do not divide 2 (every partition boundary falls
inside a parameter), in two param groups (weight decay and none), trained 3 steps with gradient clipping on a fixed
global batch of 4 sequences, 2 per rank. ``reference()`` trains the same model on the whole batch in one process."""
import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F

VOCAB, WIDTH, HIDDEN, SEQ = 11, 5, 7, 3
GLOBAL_BATCH, STEPS, CLIP = 4, 3, 0.5


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def batch(step: int, size: int = GLOBAL_BATCH):
    """The global batch of a step: `size` sequences of tokens and their targets."""
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(0, VOCAB, (size, SEQ), generator=g))


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(name: str, model):
    if name == "adamw":
        return torch.optim.AdamW(param_groups(model), lr=0.05)
    return torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)


def reference(name: str, path: str, **record_options) -> None:
    """The same training in one process on the whole global batch, plain torch, recorded to `path`."""
    import upd

    model = Block()
    optimizer = make_optimizer(name, model)
    with upd.record(path, model, optimizer, strict=True, **{"every": 1, **record_options}):
        for step in range(STEPS):
            tokens, targets = batch(step)
            # The mean of the ranks' mean losses: what DeepSpeed's averaged gradient is the gradient of.
            loss = sum(model(tokens[r::2], targets[r::2]) for r in range(2)) / 2
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()


class Collect:
    """A live sink that keeps what it is handed: [step, {param: {column: value}}] per statistics step."""

    def __init__(self):
        self.rows = []

    def write(self, steps):
        self.rows.extend([s.step, {name: dict(values) for name, values in s.params.items()}]
                         for s in steps if s.params)

    def close(self):
        pass


def run(out: str, config: str, rank: int, world: int) -> None:
    import deepspeed

    import upd

    stage, name = config.split("-")
    model = Block()
    optimizer = make_optimizer("adamw" if name == "offload" else name, model)
    zero_config = {"stage": int(stage)}
    if name == "offload":
        zero_config["offload_optimizer"] = {"device": "cpu"}
    ds_config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
                 "gradient_clipping": CLIP, "zero_optimization": zero_config, "steps_per_print": 10**9,
                 "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if rank == 0:
        with open(os.path.join(out, f"{config}.names.json"), "w") as f:
            json.dump([[n, list(p.ds_shape if hasattr(p, "ds_shape") else p.shape)]
                       for n, p in engine.module.named_parameters()], f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The engine as the model and the ZeRO optimizer deepspeed.initialize returned, as users write it; under
        # ZeRO-1 the model and the client optimizer they built instead (what `upd record` sees step); under ZeRO-3
        # no model (names from the engine found through its optimizer, as `upd record` finds them).
        given = {"1": (model, optimizer), "3": (None, zero)}.get(stage, (engine, zero))
        sink = Collect()
        rec = upd.record(os.path.join(out, f"{config}.h5"), *given, stats_every=1,
                         ranks="all" if name == "sgd" else None, sinks=[sink], every=1)
    if rank == 0:
        with open(os.path.join(out, f"{config}.warnings.json"), "w") as f:
            json.dump([[w.category.__name__, str(w.message)] for w in caught], f)
    with rec:
        for step in range(STEPS):
            tokens, targets = batch(step)
            loss = engine(tokens[rank::world], targets[rank::world])
            engine.backward(loss)
            engine.step()
    if rank == 0:  # rank 0's sinks get the job's whole parameters
        with open(os.path.join(out, f"{config}.sink.json"), "w") as f:
            json.dump(sink.rows, f)


def run_trainer(out: str, rank: int) -> None:
    """The Hugging Face Trainer with a DeepSpeed ZeRO-2 config, recorded by UpdCallback: a tiny GPT-2 (tied head),
    3 steps; rank 0 writes the model's names and shapes, and its parameters after training (all whole under
    ZeRO-2), to OUT/hf.names.json and OUT/hf.final.npz."""
    import numpy as np
    import transformers

    from upd.integrations.transformers import UpdCallback

    config = transformers.GPT2Config(n_layer=1, n_head=1, n_embd=6, vocab_size=13, n_positions=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 13, (8, 5), generator=g)]
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
                 "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    args = transformers.TrainingArguments(
        os.path.join(out, "hf-trainer"), use_cpu=True, report_to="none", max_steps=STEPS,
        per_device_train_batch_size=2, max_grad_norm=CLIP, learning_rate=1e-2, logging_steps=1, save_strategy="no",
        disable_tqdm=True, deepspeed=ds_config, ddp_backend="gloo")
    callback = UpdCallback(os.path.join(out, "hf.h5"), stats_every=1, strict=True, every=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    if rank == 0:
        with open(os.path.join(out, "hf.names.json"), "w") as f:
            json.dump([[n, list(p.shape)] for n, p in model.named_parameters()], f)
        np.savez(os.path.join(out, "hf.final.npz"),
                 **{n: p.detach().float().numpy() for n, p in model.named_parameters()})


def main() -> None:
    import deepspeed

    # DeepSpeed builds its shared-memory all-reduce op (a C++ compile, 6.5 minutes on a fresh 2-core machine) at
    # init when it is "compatible"; gloo's all-reduce does the same work, so a CPU job here never needs it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    out, configs = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for config in configs:
        if config == "hf":
            run_trainer(out, rank)
        else:
            run(out, config, rank, world)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # an exit with a live gloo group can abort at interpreter teardown


if __name__ == "__main__":
    main()
