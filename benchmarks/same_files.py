"""Files written by two versions of the recorder, compared: every dataset and attribute but wall times.

    python -m benchmarks.same_files BASELINE_ROOT [--out DIR]

Records the same seeded trainings in every mode (full, statistics at every step, lean/full mix, sparse cadence,
sampled, flight recorder with a dump, two optimizers, tensorboard=, LBFGS with and without full tensors) once with
the code under BASELINE_ROOT (e.g. a worktree of main) and once with this checkout, each in its own process, then
compares the files. Exit status 1 when any file differs. Not a speed benchmark: a refactoring's proof that what
users see did not change.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import h5py
import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WALL = {"created_unix", "wall_time", "argv"}


def clean(value):
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return strip(parsed)
    if isinstance(value, np.ndarray):
        return [clean(v) for v in value.tolist()] if value.dtype.kind == "O" else value.tolist()
    return value


def strip(obj):
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in WALL}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def items(path):
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            for k, v in obj.attrs.items():
                if k not in WALL:
                    out[f"{name}@{k}"] = clean(v)
            if isinstance(obj, h5py.Dataset):
                data = obj[()]
                if data.dtype.names:
                    out[name] = {n: (data[n].tobytes() if data[n].dtype.kind in "fciub" else clean(data[n]))
                                 for n in data.dtype.names if n not in WALL}
                elif name.split("/")[-1] in WALL:
                    out[name] = ("wall", data.shape)
                else:
                    out[name] = clean(data) if data.dtype.kind not in "fc" else data.tobytes()
        for k, v in f.attrs.items():
            if k not in WALL:
                out[f"/@{k}"] = clean(v)
        f.visititems(visit)
    return out




def record_all(out: str) -> None:
    import warnings

    import torch
    from torch import nn

    import upd

    os.makedirs(out, exist_ok=True)
    print(f"recording with {os.path.dirname(upd.__file__)} into {out}", file=sys.stderr)
    os.makedirs(out, exist_ok=True)


    def model_():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 4))


    def batches(n):
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


    def plain(name, steps=12, opt_kind="adam", log=True, **options):
        m = model_()
        if opt_kind == "two":
            opts = [torch.optim.Adam(m[0].parameters(), lr=1e-2), torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9)]
        else:
            opts = [torch.optim.Adam(m.parameters(), lr=1e-2)]
        with upd.record(f"{out}/{name}.h5", m, opts if len(opts) > 1 else opts[0], **{"every": 1, **options}) as rec:
            for i, (x, y) in enumerate(batches(steps)):
                loss = nn.functional.mse_loss(m(x), y)
                for o in opts:
                    o.zero_grad()
                loss.backward()
                if log:
                    rec.log(loss=loss, i=float(i))
                for o in opts:
                    o.step()
                if "flight_recorder" in options and i == 7:
                    rec.dump("test")


    def lbfgs(name, **options):
        m = model_()
        opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3)
        with upd.record(f"{out}/{name}.h5", m, opt, **{"every": 1, **options}) as rec:
            for x, y in batches(5):
                def closure():
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(m(x), y)
                    loss.backward()
                    return loss
                opt.step(closure)


    warnings.simplefilter("ignore")
    plain("full")
    plain("full_stats", stats_every=1)
    plain("stats_lean", every=None, stats_every=1, full_stats_every=5)
    plain("stats_every3", every=None, stats_every=3, steps=150)
    plain("sampled", every=None, stats_every=1, stats_sample=256)
    plain("flight", every=None, stats_every=2, flight_recorder=3)
    plain("two_opts", opt_kind="two", every=2, stats_every=1)
    plain("tensorboard", every=None, tensorboard=f"{out}/tb", steps=70)
    plain("nolog_stats", every=None, stats_every=1, log=False)
    lbfgs("lbfgs_full")
    lbfgs("lbfgs_stats", every=None, stats_every=1)



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", nargs="?", help="root of the code to compare against (its upd package)")
    ap.add_argument("--record", metavar="DIR", help=argparse.SUPPRESS)  # one side's recordings, in its own process
    ap.add_argument("--out", default=None, help="where to keep the runs (default: a temporary folder)")
    args = ap.parse_args()
    if args.record:
        record_all(args.record)
        return 0
    if not args.baseline:
        ap.error("give the root of the baseline code")
    out = args.out or tempfile.mkdtemp(prefix="upd-same-files-")
    for name, root in (("baseline", os.path.abspath(args.baseline)), ("this", HERE)):
        env = dict(os.environ, PYTHONPATH=root)
        # This file run by its path: `upd` is imported from `root` (PYTHONPATH), not from this checkout.
        subprocess.run([sys.executable, os.path.abspath(__file__), "--record", os.path.join(out, name)], env=env,
                       check=True, cwd=root)
    a, b = os.path.join(out, "baseline"), os.path.join(out, "this")
    bad = 0
    files = sorted(p for p in os.listdir(a) if p.endswith(".h5"))
    if files != sorted(p for p in os.listdir(b) if p.endswith(".h5")):
        print("the two versions wrote different files")
        return 1
    for name in files:
        x, y = items(os.path.join(a, name)), items(os.path.join(b, name))
        diffs = [k for k in sorted(set(x) | set(y)) if k not in x or k not in y or x[k] != y[k]]
        print(f"{name}: {len(x)} items, {'identical' if not diffs else 'DIFFERENT: ' + ', '.join(diffs[:8])}")
        bad += bool(diffs)
    print("ALL IDENTICAL" if not bad else f"{bad} FILES DIFFER", f"({out})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
