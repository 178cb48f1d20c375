"""What statistics-mode recording costs an FSDP2 job: the ratio to the same job unrecorded, measured side by side.

    python -m benchmarks.distributed_overhead [--ranks 2] [--rounds 6] [--steps 20] [--json FILE]

A small GPT-style transformer is sharded with torch.distributed.fsdp.fully_shard on `--ranks` CPU processes (gloo)
and trained with AdamW. In each process, blocks of `--steps` steps run round-robin, the order rotated each round:
plain (no recorder), and upd statistics mode (``upd.record(path, model, opt, every=None, stats_every=1)``, every rank
writing its own file). A block's median step time is divided by the plain block's median of the same round; the
table shows the median of those ratios over rounds, per rank and over all ranks. Both variants run the same
collectives; the recorder adds none.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import upd
from tests.harness.distributed import run_job


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=512, width=128, heads=4, layers=4, context=64):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _worker(rank, world_size, rounds, steps, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # our blocks return views; nothing is in place
    torch.manual_seed(0)
    model = TinyGPT()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)

    def block_times() -> list[float]:
        times = []
        for _ in range(steps):
            tokens = torch.randint(0, 512, (8, 64), generator=g)
            start = time.perf_counter()
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
        return times

    ratios, plain_medians = alternating_rounds(
        block_times, rounds, lambda path: upd.record(path, model, opt, every=None, stats_every=1, overwrite=True),
        folder)
    params = sum(p.numel() for p in model.parameters())
    return {"rank": rank, "ratios": ratios, "plain_step_s": plain_medians, "params": params}


def alternating_rounds(block_times, rounds: int, recording, folder: str) -> tuple[list, list]:
    """(recorded over plain median step time per round, plain median step times): every rank runs a block of plain
    steps and a block under `recording(path)` in each round, their order alternated, the ranks joined before each."""
    block_times()  # warm-up: first steps allocate the optimizer state
    variants = ["plain", "stats"]
    ratios, plain_medians = [], []
    for r in range(rounds):
        medians = {}
        for variant in variants[r % 2:] + variants[:r % 2]:
            dist.barrier()
            if variant == "plain":
                medians[variant] = statistics.median(block_times())
            else:
                with recording(os.path.join(folder, f"round{r}.h5")):
                    medians[variant] = statistics.median(block_times())
        ratios.append(medians["stats"] / medians["plain"])
        plain_medians.append(medians["plain"])
    return ratios, plain_medians


def print_ratios(results: list) -> None:
    """Each rank's statistics-mode ratios (alternating_rounds), then all ranks'."""
    print("statistics mode / unrecorded, median step time, median over rounds [min, max]:")
    everything = []
    for r in results:
        everything += r["ratios"]
        print(f"  rank {r['rank']}: {statistics.median(r['ratios']):.3f} "
              f"[{min(r['ratios']):.3f}, {max(r['ratios']):.3f}]; unrecorded step "
              f"{1e3 * statistics.median(r['plain_step_s']):.1f} ms")
    print(f"  all ranks: {statistics.median(everything):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = run_job(_worker, args.ranks, args.rounds, args.steps, folder, timeout=3600)
    print(f"FSDP2 TinyGPT ({results[0]['params'] / 1e6:.2f}M parameters), {args.ranks} ranks (gloo, CPU), AdamW, "
          f"{args.rounds} rounds x {args.steps} steps per variant; load average {os.getloadavg()[0]:.2f}")
    print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
