"""What statistics-mode recording costs a DeepSpeed ZeRO-2 job: the ratio to the same job unrecorded, side by side.

    python -m benchmarks.deepspeed_overhead [--ranks 2] [--rounds 4] [--steps 10] [--groups 2] [--json FILE]

The GPT-style transformer of benchmarks.distributed_overhead runs under ``deepspeed.initialize`` with ZeRO stage 2 on
`--ranks` CPU processes (DS_ACCELERATOR=cpu, gloo), a torch AdamW as the client optimizer in `--groups` param groups
(2: weight decay and none, as the Hugging Face Trainer builds them, so DeepSpeed steps its optimizer twice per step
and torch-upd keeps one copy of the first group's partition; 1: nothing is copied), gradient clipping on. In each
process, blocks of `--steps` steps run round-robin, the order rotated each round: plain (no recorder) and upd
statistics mode (``upd.record(path, engine, optimizer, every=None, stats_every=1)``, every rank writing its own
file). A block's median step time is divided by the plain block's median of the same round; the table shows the
median of those ratios over rounds, per rank and over all ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F

import upd
from benchmarks.distributed_overhead import TinyGPT, alternating_rounds, print_ratios
from tests.harness.distributed import run_job


def _worker(rank, world_size, rounds, steps, groups, folder):
    import deepspeed

    # DeepSpeed builds its shared-memory all-reduce op (a C++ compile, 6.5 minutes on a fresh 2-core machine) at
    # init when it is "compatible"; gloo's all-reduce does the same work, so a CPU job here never needs it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyGPT()
    if groups == 2:
        params = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    else:
        params = model.parameters()
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-3),
                                                   config=config)
    g = torch.Generator().manual_seed(rank)

    def block_times() -> list[float]:
        times = []
        for _ in range(steps):
            tokens = torch.randint(0, 512, (8, 64), generator=g)
            start = time.perf_counter()
            loss = F.cross_entropy(engine(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    ratios, plain_medians = alternating_rounds(
        block_times, rounds,
        lambda path: upd.record(path, engine, optimizer, every=None, stats_every=1, strict=True), folder)
    return {"rank": rank, "ratios": ratios, "plain_step_s": plain_medians,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, choices=(1, 2), default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the spawned ranks before they import deepspeed
    with tempfile.TemporaryDirectory() as folder:
        results = run_job(_worker, args.ranks, args.rounds, args.steps, args.groups, folder, timeout=3600)
    print(f"DeepSpeed ZeRO-2 TinyGPT ({results[0]['params'] / 1e6:.2f}M parameters), {args.ranks} ranks (gloo, CPU), "
          f"AdamW in {args.groups} param group(s), {args.rounds} rounds x {args.steps} steps per variant; "
          f"load average {os.getloadavg()[0]:.2f}")
    print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "groups": args.groups, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
