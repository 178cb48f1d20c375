"""Time the demo's pieces for both inits: train(), the run file's size, ratios() and verify().

    python -m benchmarks.demo_timing [--steps N] [--every N] [--threads N]
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
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for ratios() and verify() (train() always uses one); default: torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    kwargs = {} if args.steps is None else {"steps": args.steps}

    with tempfile.TemporaryDirectory() as tmp:
        for init in ("good", "bad"):
            path = os.path.join(tmp, f"{init}.h5")
            t, cpu = time.perf_counter(), time.process_time()
            out = train(path, init=init, every=args.every, log=None, **kwargs)
            t_train, cpu_train = time.perf_counter() - t, time.process_time() - cpu
            t, cpu = time.perf_counter(), time.process_time()
            with upd.open_run(path) as run:
                df = run.ratios()
                weights = [p.name for p in run.iter_params() if len(p.shape) >= 2]
            t_ratios, cpu_ratios = time.perf_counter() - t, time.process_time() - cpu
            t, cpu = time.perf_counter(), time.process_time()
            report = upd.verify(path)
            t_verify, cpu_verify = time.perf_counter() - t, time.process_time() - cpu

            print(f"== init={init}: {out['steps']} steps, {out['records']} records")
            print(f"   file {os.path.getsize(path) / 2**20:.1f} MiB   verify exit_code {report.exit_code}")
            print(f"   seconds, wall (cpu): train {t_train:.2f} ({cpu_train:.2f})   ratios {t_ratios:.2f} "
                  f"({cpu_ratios:.2f})   verify {t_verify:.2f} ({cpu_verify:.2f})")
            print(f"   loss: first batch {out['train_loss_start']:.3f}  final train {out['final_loss']:.3f}  "
                  f"val {out['val_loss']:.3f}")
            medians = df.groupby("param")["update_to_data"].median()
            print("   median update_to_data (log10) over the run, weights (ndim >= 2):")
            print("     " + "  ".join(f"{name} {medians[name]:.2f}" for name in weights))


if __name__ == "__main__":
    main()
