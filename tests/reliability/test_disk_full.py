"""A real "disk full": the process may not grow any file past a limit (RLIMIT_FSIZE), as on a full volume.

Training must go on, with exactly one warning; every step committed before the failure stays readable.
"""
import textwrap

import pytest

import upd
from tests.harness import disk_full, forked

resource = pytest.importorskip("resource")
pytestmark = pytest.mark.slow  # each test trains in a child process until a write fails

SCRIPT = textwrap.dedent("""
    import resource, signal, sys, warnings, torch, upd
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # write() then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (3_000_000, 3_000_000))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(sys.argv[1], model, opt, every=1, strict=sys.argv[2] == "strict") as rec:
            for step in range(60):                          # ~100 KB per step: the limit is hit half-way
                model(torch.randn(16, 64)).pow(2).mean().backward()
                opt.step(); opt.zero_grad()
    kinds = [type(w.message).__name__ for w in caught]
    print("steps", step + 1, "warnings", kinds.count("RecorderWarning"), "error", type(rec.error).__name__)
""")


# Two limits 37 KB apart (a record is about 100 KB), one process each: the limit falls at two places in a record.
RESERVE_LIMITS = (2_000_000, 2_037_001)


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Every child of this file, forked one after the other from one process that imported torch once
    (tests.harness.forked): {name: (path, Done)}."""
    tmp = tmp_path_factory.mktemp("disk_full")
    programs = {mode: (SCRIPT, [str(tmp / f"{mode}.h5"), mode]) for mode in ("lenient", "strict")}
    for limit in RESERVE_LIMITS:
        programs[limit] = disk_full.program(str(tmp / f"reserve-{limit}.h5"), limit, "reserve")
    done = forked.run_forked(list(programs.values()))
    return {name: (args[0], d) for (name, (_, args)), d in zip(programs.items(), done)}


def test_training_survives_a_full_disk(children):
    path, proc = children["lenient"]
    assert proc.returncode == 0, proc.stderr
    assert "steps 60 warnings 1 error OSError" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "RuntimeError" not in proc.stderr
    with upd.open_run(path) as run_:
        committed = run_.optimizers[0].num_records
    assert 0 < committed < 60
    report = upd.verify(path)
    assert report.exit_code == 0 and report.matched == committed * 4


def test_strict_raises_the_disk_error(children):
    path, proc = children["strict"]
    assert proc.returncode != 0 and "OSError" in proc.stderr


def test_the_reservation_alone_stops_a_record_the_disk_cannot_take(children):
    # The free-space estimate switched off (as when another process fills the disk after it looked): fallocate of
    # the record's bytes must fail first, before HDF5 writes any of it. `python -m benchmarks.disk_full` shows the
    # same trials without either defence: training crashes and the run is unreadable in every one.
    for limit in RESERVE_LIMITS:
        path, proc = children[limit]
        r = disk_full.read_trial(path, limit, "reserve", proc)
        assert disk_full.ok(r), r
        assert r["disk_error"] and 0 < r["records"] < 60, r  # the limit was met, not trained under
