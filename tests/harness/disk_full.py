"""Fill the "disk" under a recording process at a chosen size and check that the run stays readable.

Each child trains a small Adam model for 60 steps with `upd.record` (about 100 KB per record) under a file-size
limit (RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past it fails with EFBIG as on a full volume). Modes switch off
the writer's defences to show what each buys:

- estimate+reserve: the shipped writer (free-space estimate, then fallocate of the record's bytes);
- reserve: the estimate disabled; the reservation alone must stop the record before anything is written;
- estimate: the reservation disabled;
- none: both disabled: HDF5 meets the full disk in the middle of a write.

A trial passes when training finished all 60 steps (exit 0), the run opens, and `upd verify` passes on it.
tests/reliability/test_disk_full.py runs a few trials, `python -m benchmarks.disk_full` every mode.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

DISABLE = {
    "estimate": textwrap.dedent("""
        import collections, upd.runfile.writer as W
        W.resource = None
        class _Usage:
            @staticmethod
            def disk_usage(path):
                return collections.namedtuple("Usage", "free")(10 ** 15)
        W.shutil = _Usage
    """),
    "reserve": "import os\nos.posix_fallocate = lambda fd, offset, length: None\n",
}
MODES = {"estimate+reserve": (), "reserve": ("estimate",), "estimate": ("reserve",), "none": ("estimate", "reserve")}

CHILD = textwrap.dedent("""
    import resource, signal, sys, warnings, torch, upd
    exec(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # write() then fails with EFBIG instead of killing us
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(sys.argv[1], model, opt, every=1) as rec:  # full tensors every step: ~100 KB each
            for step in range(60):
                model(torch.randn(16, 64)).pow(2).mean().backward()
                opt.step(); opt.zero_grad()
    kinds = [type(w.message).__name__ for w in caught]
    print("steps", step + 1, "warnings", kinds.count("RecorderWarning"), "error", type(rec.error).__name__)
""")


def program(path: str, limit: int, mode: str) -> tuple:
    """(code, args) of the child for one trial: `python -c CODE ARGS...`."""
    return CHILD, [path, str(limit), "".join(DISABLE[d] for d in MODES[mode])]


def trial(path: str, limit: int, mode: str) -> dict:
    code, args = program(path, limit, mode)
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    return read_trial(path, limit, mode, proc)


def read_trial(path: str, limit: int, mode: str, proc) -> dict:
    """The trial's result from its finished child `proc` (returncode, stdout) and the run it left at `path`;
    "disk_error": the recorder met the limit (one warning, its error an OSError) rather than finishing under it."""
    import upd

    result = {"mode": mode, "limit": limit, "exit": proc.returncode, "finished": "steps 60" in proc.stdout,
              "disk_error": "warnings 1 error OSError" in proc.stdout, "records": None, "verify": None, "error": None}
    try:
        with upd.open_run(path) as run:
            result["records"] = run.optimizers[0].num_records
        result["verify"] = upd.verify(path).exit_code
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return result


def ok(result: dict) -> bool:
    return result["exit"] == 0 and result["finished"] and result["error"] is None and result["verify"] == 0


def run_trials(limits: int, mode: str, workdir: str | None = None, first: int = 2_000_000) -> list:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        return [trial(os.path.join(tmp, f"run{i}.h5"), first + i * 37_001, mode) for i in range(limits)]
