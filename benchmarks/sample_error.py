"""How far the sampled statistics (``upd.record(stats_sample=K)``) are from the exact ones, on real training runs.

    python -m benchmarks.sample_error [--workloads transformer,mlp] [--steps N] [--samples 1024,4096,16384]
                                      [--blocks 1,16] [--exact-norms "grad;param,grad"] [--json FILE]

One training run per workload carries several recorders at once, each on its own file: the exact lean statistics
(the default) and one per (sample size, block size) asked for. The recorders only read the tensors, so every one of
them sees the same training, step for step. For every parameter that is sampled (more than K elements) and every
step, the error of a ratio is |log10 ratio(sampled) - log10 ratio(exact)| (the ratios are log10 already: a
difference of 0.01 is a factor of 1.023); the table gives its median, 99th percentile and maximum over all
(parameter, step) pairs, for update:data and grad:data. Parameters of at most K elements are exact and left out.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch

import upd
from benchmarks.overhead import gpt_workload, mlp_workload, table
from benchmarks.stats_overhead import tiny_workload
from upd.ratios import GRAD_TO_DATA, UPDATE_TO_DATA
from upd.recorder.sampled_stats import SampledPool

WORKLOADS = {"transformer": gpt_workload, "mlp": mlp_workload, "tiny": tiny_workload}


def record_together(w, workdir: str, configs: list[tuple[int, int, tuple]], steps: int) -> dict:
    """Train `w` for `steps` steps under an exact recorder and one sampled recorder per (sample, block, kinds whose
    norms are exact); their statistics tables by config (None: exact)."""
    recorders = {None: upd.record(os.path.join(workdir, f"{w.name}-exact.h5"), w.model, w.opt, every=None,
                                  stats_every=1, full_stats_every=None, overwrite=True, strict=True)}
    for sample, block, norms in configs:
        rec = upd.record(os.path.join(workdir, f"{w.name}-{sample}-{block}-{'-'.join(norms)}.h5"), w.model, w.opt,
                         every=None, stats_every=1, full_stats_every=None, overwrite=True, strict=True,
                         stats_sample=sample)
        rec._tracks[0].sampled_pool = SampledPool(sample, block, norms)  # the variant under test
        recorders[(sample, block, norms)] = rec
    for _ in range(steps):
        w.forward_backward()
        w.opt.step()
    tables = {}
    for config, rec in recorders.items():
        rec.close()
        with upd.open_run(rec.path) as run:
            tables[config] = run.stats().set_index(["param", "step"]).sort_index()
    return tables


def errors(exact, sampled, sample: int, sizes: dict) -> dict:
    """Median, p99 and max of |log10 error| of both ratios over the sampled parameters' (parameter, step) rows."""
    big = [name for name, n in sizes.items() if n > sample]
    out = {"params": len(big)}
    for column in (UPDATE_TO_DATA, GRAD_TO_DATA):
        e = np.abs(sampled.loc[big, column].to_numpy() - exact.loc[big, column].to_numpy())
        e = e[np.isfinite(e)]
        if not e.size:  # no parameter of more than `sample` elements: all exact
            e = np.zeros(1)
        out[column] = {"median": float(np.median(e)), "p99": float(np.quantile(e, 0.99)), "max": float(e.max()),
                       "rows": int(e.size)}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="transformer,mlp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", default="1024,4096,16384")
    parser.add_argument("--blocks", default="1", help="contiguous elements per sampled block (1: single elements)")
    parser.add_argument("--exact-norms", default="grad",
                        help="';'-separated choices of the kinds whose norms are exact, e.g. 'grad;param,grad'")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = [(int(s), int(b), tuple(n.split(","))) for s in args.samples.split(",") for b in args.blocks.split(",")
               for n in args.exact_norms.split(";")]
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.workloads.split(","):
            w = WORKLOADS[name]()
            sizes = {n: p.numel() for n, p in w.model.named_parameters()}
            tables = record_together(w, workdir, configs, args.steps)
            rows = []
            for sample, block, norms in configs:
                e = errors(tables[None], tables[(sample, block, norms)], sample, sizes)
                results.append({"workload": name, "sample": sample, "block": block, "exact_norms": norms, **e})
                rows.append([str(sample), str(block), ",".join(norms), f"{e['params']}/{len(sizes)}"]
                            + [f"{e[c][q]:.4f}" for c in (UPDATE_TO_DATA, GRAD_TO_DATA)
                               for q in ("median", "p99", "max")])
            print(f"### {name}: {w.desc}; {args.steps} steps")
            print(table(["stats_sample", "block", "exact norms", "sampled tensors", "update:data median", "p99", "max",
                         "grad:data median", "p99", "max"], rows))
            print(flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
