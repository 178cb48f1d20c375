"""Time the demo's pieces for both inits: train(), the run file's size, ratios() and verify().

    python benchmarks/demo_timing.py [--steps N] [--every N] [--threads N]
"""
import argparse
import os
import tempfile
import time

import torch

import upd
from upd.demo.makemore import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: train()'s own")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch threads; the demo budget assumes 2 CPU cores")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = {} if args.steps is None else {"steps": args.steps}

    with tempfile.TemporaryDirectory() as tmp:
        for init in ("good", "bad"):
            path = os.path.join(tmp, f"{init}.h5")
            t = time.perf_counter()
            out = train(path, init=init, every=args.every, log=None, **kwargs)
            t_train = time.perf_counter() - t
            t = time.perf_counter()
            with upd.open_run(path) as run:
                df = run.ratios()
            t_ratios = time.perf_counter() - t
            t = time.perf_counter()
            report = upd.verify(path)
            t_verify = time.perf_counter() - t

            print(f"== init={init}: {out['steps']} steps, {out['records']} records")
            print(f"   train {t_train:.2f} s   file {os.path.getsize(path) / 2**20:.1f} MiB   "
                  f"ratios {t_ratios:.2f} s   verify {t_verify:.2f} s (exit_code {report.exit_code})")
            print(f"   loss: first batch {out['train_loss_start']:.3f}  final train {out['final_loss']:.3f}  "
                  f"val {out['val_loss']:.3f}")
            weights = df[df["numel"] > 1].groupby("param", sort=False)["update_to_data"].median()
            shapes = {p.name: tuple(p.shape) for p in run.iter_params()}
            print("   median update_to_data (log10) of the weights:")
            for name, med in weights.items():
                if len(shapes[name]) >= 2:
                    print(f"     {name:18s} {str(shapes[name]):10s} {med:6.2f}")


if __name__ == "__main__":
    main()
