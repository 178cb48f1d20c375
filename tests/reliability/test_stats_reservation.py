"""Statistics-only recording reserves what a batch needs, not the metadata slack once per row: on a nearly full
disk (here: a file-size limit about 1 MB away) it records. Before, each batch of up to 64 rows of about 160 bytes
reserved 64 times 272 KB, so with 528 KB free it recorded nothing."""
import subprocess
import sys
import textwrap

import pytest

import upd

resource = pytest.importorskip("resource")

SCRIPT = textwrap.dedent("""
    import resource, signal, sys, warnings, torch, upd
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # write() then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(sys.argv[1], model, opt, every=None, stats_every=1) as rec:
            for step in range(200):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step(); opt.zero_grad()
    print("warnings", sum(type(w.message).__name__ == "RecorderWarning" for w in caught), flush=True)
""")


@pytest.mark.slow
def test_statistics_only_recording_fits_a_nearly_full_disk(tmp_path):
    path = str(tmp_path / "run.h5")
    done = subprocess.run([sys.executable, "-c", SCRIPT, path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with upd.open_run(path) as run:
        steps = run.stats()["step"].nunique()
    assert steps == 200 and "warnings 0" in done.stdout, (steps, done.stdout, done.stderr)
