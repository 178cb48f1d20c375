"""The file size the default cadence gives (upd/recorder/cadence.py): measured on the 5.8M-parameter GPT, projected
from parameter counts for GPT-2 small (124M).

    python -m benchmarks.default_cadence [--steps N]

Records the reference transformer (benchmarks.overhead.gpt_workload, AdamW) twice for ``--steps`` steps (fewer than
the default cadence's first multiple): with statistics only, and with the default options, which add full records
at the first ``cadence.FIRST_FULL_STEPS`` steps: the difference is
what those full records took (measured), against ``cadence.full_record_bytes`` (predicted); the first run's size per
step is a statistics step's plus the file's fixed structure (an upper bound for short runs). The 124M figures scale the statistics by the number of tensors (a statistics row is a
few numbers per tensor, whatever its size) and take the full record from ``full_record_bytes``.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import upd
from benchmarks.overhead import gpt_workload
from upd.recorder import cadence

GPT2_SMALL_PARAMS = 124_439_808  # GPT-2 small, tied embeddings (nanoGPT's count)
GPT2_SMALL_TENSORS = 148  # wte, wpe, 12 blocks of 12 (two LayerNorms, four Linears, each weight and bias), ln_f


def recorded_size(steps: int, **options) -> int:
    """The closed run's bytes after `steps` steps of the reference transformer recorded with `options`."""
    w = gpt_workload()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.h5")
        with upd.record(path, w.model, w.opt, **options):
            for _ in range(steps):
                w.forward_backward()
                w.opt.step()
        return os.path.getsize(path)


def measure(steps: int) -> dict:
    w = gpt_workload()
    param_bytes = sum(p.numel() * p.element_size() for p in w.params)
    predicted = cadence.full_record_bytes(param_bytes, cadence.state_tensors(type(w.opt).__name__))
    stats_only = recorded_size(steps, every=None, stats_every=1)
    with_first = recorded_size(steps)  # the default: statistics at every step, full records at the first steps
    return {"params": w.numel, "tensors": len(w.params), "predicted_record": predicted, "every": cadence.default_every(predicted),
            "stats_step": stats_only / steps, "full_record": (with_first - stats_only) / cadence.FIRST_FULL_STEPS,
            "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    found = measure(args.steps)
    print(f"5.8M GPT ({found['params'] / 1e6:.2f}M params, AdamW), {found['steps']} steps measured: full record "
          f"{cadence.size_text(found['full_record'])} (the first has no Adam state yet; predicted with state: "
          f"{cadence.size_text(found['predicted_record'])}), statistics "
          f"{cadence.size_text(found['stats_step'])} per step; default every={found['every']}")
    for label, params in (("5.8M GPT", found["params"]), ("GPT-2 small", GPT2_SMALL_PARAMS)):
        record = cadence.full_record_bytes(4 * params, cadence.state_tensors("AdamW"))
        every = cadence.default_every(record)
        stats = found["stats_step"] if label == "5.8M GPT" else found["stats_step"] * GPT2_SMALL_TENSORS / found["tensors"]
        print(f"{label}: full record {cadence.size_text(record)}, default every={every}: the first "
              f"{cadence.FIRST_FULL_STEPS} steps {cadence.size_text(cadence.FIRST_FULL_STEPS * record)}, then "
              f"{cadence.size_text(cadence.bytes_per_1000_steps(record, every))} of full records and about "
              f"{cadence.size_text(1000 * stats)} of statistics per 1,000 steps")


if __name__ == "__main__":
    main()
